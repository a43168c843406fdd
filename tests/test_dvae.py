"""The discrete VAE: training lowers the reconstruction loss, codes and decoding, loss terms, config errors."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from efftx.config import Config, VAEConfig
from efftx.errors import ConfigError
from efftx.models.dvae import DiscreteVAE, codebook_usage, temperature

TINY = dict(image_size=16, num_layers=2, hidden_dim=32, num_resnet_blocks=1, num_tokens=64, codebook_dim=32)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def shape_images(n: int, size: int = 16, channels: int = 3, seed: int = 0) -> torch.Tensor:
    """n images in [0, 1]: a square or a disc of one random colour on a background of another."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    out = np.empty((n, channels, size, size), np.float32)
    for i in range(n):
        bg, fg = rng.random(channels), rng.random(channels)
        cy, cx = rng.integers(4, size - 4, 2)
        r = rng.integers(2, 5)
        disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        square = (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
        out[i] = np.where((disc if i % 2 else square)[None], fg[:, None, None], bg[:, None, None])
    return torch.from_numpy(out)


def tiny_vae(seed: int = 0, **overrides) -> DiscreteVAE:
    torch.manual_seed(seed)
    return DiscreteVAE(VAEConfig(**{**TINY, **overrides}))


def test_reconstruction_loss_falls_on_a_fixed_batch():
    vae = tiny_vae(temperature_anneal=0.0).train()
    images = shape_images(8)
    opt = torch.optim.Adam(vae.parameters(), lr=3e-3)
    history = []
    for step in range(60):
        loss, metrics = vae(images, temperature(vae.cfg, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(metrics["recon_loss"].item())
    assert all(math.isfinite(v) for v in history)
    assert np.mean(history[-5:]) < 0.5 * history[0]
    eval_loss, _ = vae.eval()(images)  # the deterministic (argmax) codes reconstruct too
    assert eval_loss.item() < 0.6 * history[0]


@pytest.mark.parametrize("channels", [3, 4])
def test_codebook_indices_and_decode(channels):
    vae = tiny_vae(channels=channels).eval()
    images = shape_images(5, channels=channels)
    codes = vae.get_codebook_indices(images)
    assert codes.shape == (5, 4 * 4) and codes.dtype == torch.long
    assert 0 <= codes.min() and codes.max() < vae.num_tokens
    decoded = vae.decode(codes)
    assert decoded.shape == (5, channels, 16, 16)
    assert decoded.min() >= 0 and decoded.max() <= 1
    torch.testing.assert_close(vae.reconstruct(images), decoded)
    with pytest.raises(ValueError, match=r"\(batch, 16\) code indices"):
        vae.decode(codes[:, :5])
    with pytest.raises(ValueError, match="vae.channels, vae.image_size"):
        vae.get_codebook_indices(torch.rand(2, channels, 32, 32))


def test_normalisation_comes_from_the_config():
    vae = tiny_vae(channels=4, norm_means="0.5,0.5,0.5,0,9", norm_stds="0.5,0.5,0.5,1,9")
    x = torch.rand(2, 4, 16, 16)
    normed = vae.normalize(x)
    torch.testing.assert_close(normed[:, :3], (x[:, :3] - 0.5) / 0.5)
    torch.testing.assert_close(normed[:, 3], x[:, 3])  # alpha: mean 0, std 1; the fifth value is unused
    torch.testing.assert_close(vae.denormalize(normed), x)


def test_temperature_anneals_to_its_floor():
    vc = VAEConfig(temperature=1.0, temperature_min=0.5, temperature_anneal=1e-3)
    assert temperature(vc, 0) == 1.0
    assert temperature(vc, 100) == pytest.approx(math.exp(-0.1))
    assert temperature(vc, 100) > temperature(vc, 200) > 0.5
    assert temperature(vc, 10_000) == 0.5


def test_codebook_usage_perplexity_and_dead_codes():
    one = codebook_usage(torch.full((4, 9), 3), 16)
    assert one["perplexity"].item() == pytest.approx(1.0) and one["dead_codes"].item() == 15
    every = codebook_usage(torch.arange(16).repeat(3), 16)
    assert every["perplexity"].item() == pytest.approx(16.0) and every["dead_codes"].item() == 0
    half = codebook_usage(torch.tensor([0, 0, 1, 1]), 4)
    assert half["perplexity"].item() == pytest.approx(2.0) and half["dead_codes"].item() == 2


def test_loss_terms_follow_the_config():
    images = shape_images(4)
    vae = tiny_vae(kl_weight=0.3, recon_loss="smooth_l1").eval()
    loss, m = vae(images)
    assert m["kl"] >= 0
    torch.testing.assert_close(loss, m["recon_loss"] + 0.3 * m["kl"])
    # evaluation decodes the argmax codes, deterministically; the reconstruction term is smooth-L1
    codes = F.one_hot(vae.logits(images).argmax(1), vae.num_tokens).permute(0, 3, 1, 2).float()
    expected = F.smooth_l1_loss(vae.decode_onehot(codes), vae.normalize(images))
    torch.testing.assert_close(m["recon_loss"], expected)
    torch.testing.assert_close(vae(images)[0], loss)
    # codebook usage of the batch
    assert 1 <= m["perplexity"] <= vae.num_tokens and 0 <= m["dead_codes"] < vae.num_tokens


@pytest.mark.parametrize("straight_through", [False, True])
def test_gumbel_codes_and_gradients(straight_through):
    vae = tiny_vae(straight_through=straight_through).train()
    seen = {}
    vae.decoder.register_forward_pre_hook(lambda mod, args: seen.update(z=args[0].detach()))
    loss, _ = vae(shape_images(4), 0.7)
    loss.backward()
    z = seen["z"].permute(0, 2, 3, 1).reshape(-1, vae.codebook.embedding_dim)  # decoder input per grid cell
    dist = torch.cdist(z, vae.codebook.weight.detach(), compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values
    if straight_through:  # hard one-hot forward: every cell is exactly one codebook vector
        assert dist.max() < 1e-5
    else:  # soft mixtures
        assert dist.max() > 1e-3
    first = vae.encoder[0].weight.grad  # gradients reach the encoder through the relaxation either way
    assert first is not None and first.abs().sum() > 0


@pytest.mark.parametrize("overrides, message", [
    ({"vae.image_size": 18}, "vae.image_size=18 must be divisible by 2\\*\\*vae.num_layers"),
    ({"vae.channels": 2}, "vae.channels must be 1, 3 or 4"),
    ({"vae.norm_stds": "0.5,0,0.5"}, "vae.norm_stds must be > 0"),
    ({"vae.norm_means": "0.5,0.5"}, "vae.norm_means has 2 values"),
    ({"vae.norm_means": "a,b,c"}, "vae.norm_means must be comma-separated numbers"),
    ({"vae.recon_loss": "l1"}, "vae.recon_loss must be one of mse, smooth_l1"),
    ({"vae.temperature_min": 2.0}, "vae.temperature_min=2.0 exceeds vae.temperature"),
])
def test_bad_vae_config_is_a_clear_error(overrides, message):
    cfg = Config().override(overrides)
    cfg.name = "x"
    with pytest.raises(ConfigError, match=message):
        cfg.validate()
    with pytest.raises(ConfigError, match=message):
        DiscreteVAE(cfg.vae)


def test_flops_count_every_convolution():
    vae = tiny_vae(num_resnet_blocks=0, num_layers=1, hidden_dim=4, num_tokens=8, codebook_dim=2)
    # encoder conv 3->4 k4 at 8x8, 1x1 4->8 at 8x8; decoder convT 2->4 k4 from 8x8, 1x1 4->3 at 16x16; mixing 8x2 at 8x8
    macs = 3 * 4 * 16 * 64 + 4 * 8 * 64 + 2 * 4 * 16 * 64 + 4 * 3 * 256 + 8 * 2 * 64
    assert vae.flops_per_image() == 6 * macs


@pytest.mark.parametrize("name", ["dvae_shapes_debug", "dalle_shapes_debug"])
def test_a_half_precision_engines_model_trains_and_draws(name):
    """A bf16/fp16 DeepSpeed engine casts the parameters and keeps the buffers (the images' mean and std) in fp32:
    the dVAE and DALL-E (its frozen dVAE) still train a step and draw images, in bf16 here (the GPU's fp16 alike).
    Power: fp32 statistics promoted the half images to fp32 before the half convolutions ("Input type (float) and
    bias type (c10::BFloat16) should be the same")."""
    from efftx import models, recipes
    from efftx.generation.images import generate_images

    cfg = recipes.get(name)
    torch.manual_seed(0)
    model = models.build(cfg).train()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())  # as DeepSpeed leaves them
    images = torch.rand(2, cfg.vae.channels, cfg.vae.image_size, cfg.vae.image_size).to(torch.bfloat16)
    if name.startswith("dalle"):
        text = torch.randint(1, cfg.model.vocab_size, (2, cfg.dalle.text_seq_len))
        loss, _ = model(text, images)
    else:
        loss, _ = model(images, temperature=1.0)
    loss.backward()
    assert torch.isfinite(loss)
    model.eval()
    with torch.no_grad():
        if name.startswith("dalle"):
            drawn, _ = generate_images(model, text[:1], seed=0)
        else:
            drawn = model.reconstruct(images)
    assert drawn.shape[-2:] == images.shape[-2:] and torch.isfinite(drawn.float()).all()
