"""DALL-E: attention patterns (mask semantics, cached decoding), the model (padding, losses, sharing, frozen
dVAE, guidance, export) and image generation (cached == uncached, with and without guidance)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from efftx import attention, models
from efftx.attention.base import AttentionSpec
from efftx.attention.patterns import ConvLikeOptions, ImageLayout, SparseOptions, pattern_names
from efftx.config import Config
from efftx.errors import ConfigError
from efftx.generation.images import generate_image_tokens, generate_images, top_k_of_thres
from efftx.models.dalle import DALLE
from efftx.models.dvae import DiscreteVAE

PATTERNS = ["axial_row", "axial_col", "conv_like", "sparse"]
V, N, FMAP, K = 20, 6, 4, 24  # text vocabulary (pad 0 included), caption length, token grid side, codes
TEXT_LEN, M = N + 1, FMAP * FMAP

BASE = {
    "model.family": "dalle", "model.vocab_size": V, "model.dim": 32, "model.depth": 2, "model.heads": 4,
    "model.kv_heads": 2, "dalle.text_seq_len": N, "vae.image_size": 16, "vae.num_layers": 2,
    "vae.hidden_dim": 8, "vae.num_resnet_blocks": 1, "vae.num_tokens": K, "vae.codebook_dim": 8,
    "attention.conv_like.kernel_size": 3, "attention.sparse.block_size": 4, "attention.sparse.local_blocks": 2,
    "attention.sparse.random_blocks": 1,
}
MIXED = {"dalle.attn_types": "full,axial_row,axial_col,conv_like,sparse", "model.depth": 5}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def config(**overrides) -> Config:
    cfg = Config().override({**BASE, **overrides})
    cfg.name = "test"
    return cfg.validate()


def tiny(seed: int = 0, **overrides) -> DALLE:
    torch.manual_seed(seed)
    return models.build(config(**overrides)).eval()


def captions(b: int = 2, seed: int = 1) -> torch.Tensor:
    """Caption ids (B, N): a random number of tokens in [1, V), then padding 0."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, V, (b, N), generator=g)
    lengths = torch.randint(1, N, (b,), generator=g)
    return text.masked_fill(torch.arange(N)[None] >= lengths[:, None], 0)


def joint_sequence(model: DALLE, b: int = 2, seed: int = 1) -> torch.Tensor:
    """A full input sequence (B, N + M): prepared text, then image codes."""
    g = torch.Generator().manual_seed(seed + 100)
    codes = torch.randint(0, K, (b, M - 1), generator=g)
    return torch.cat([model.prepare_text(captions(b, seed)), codes], dim=1)


# ------------------------------------------------------------------------------------------ patterns

def expected_mask(kind: str, layout: ImageLayout, backend) -> torch.Tensor:
    """The pattern rules, position by position, written independently of the backend's tensor code."""
    s, f, text_len = layout.seq_len, layout.fmap, layout.text_len
    out = torch.zeros(s, s, dtype=torch.bool)
    for q in range(s):
        for k in range(q + 1):
            if q < text_len or k < text_len:
                out[q, k] = True  # text is fully causal; image sees all text
                continue
            (rq, cq), (rk, ck) = divmod(q - text_len, f), divmod(k - text_len, f)
            if kind == "axial_row":
                out[q, k] = rq == rk
            elif kind == "axial_col":
                out[q, k] = cq == ck
            elif kind == "conv_like":
                size, dil = layout.options.kernel_size, layout.options.dilation
                out[q, k] = all(0 <= d <= (size - 1) * dil and d % dil == 0 for d in (rq - rk, cq - ck))
            else:
                bs, local = layout.options.block_size, layout.options.local_blocks
                bq, bk = q // bs, k // bs
                out[q, k] = bq - bk < local or bool(backend.block_layout()[bq, bk])
    return out


LAYOUT_OPTIONS = {
    "axial_row": [None], "axial_col": [None],
    "conv_like": [ConvLikeOptions(kernel_size=3, dilation=1), ConvLikeOptions(kernel_size=3, dilation=2)],
    "sparse": [SparseOptions(block_size=4, local_blocks=2, random_blocks=1)],
}
CASES = [(kind, opts) for kind in PATTERNS for opts in LAYOUT_OPTIONS[kind]]


def build_backend(kind, opts, stable=False, layer_index=0):
    layout = ImageLayout(text_len=5, fmap=4, stable=stable, options=opts)
    spec = AttentionSpec(kind=kind, dim=16, heads=4, kv_heads=2, head_dim=8, max_seq_len=layout.seq_len,
                         options=layout, layer_index=layer_index)
    return attention.build(spec), layout


def test_patterns_are_registered():
    assert sorted(pattern_names()) == sorted(PATTERNS)
    assert all(name in attention.names() for name in PATTERNS)


@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("kind, opts", CASES)
def test_each_position_sees_exactly_its_pattern(kind, opts, stable):
    """Perturbing a key changes a query's output exactly when the pattern lets the query see it."""
    backend, layout = build_backend(kind, opts, stable)
    expected = expected_mask(kind, layout, backend)
    torch.testing.assert_close(backend.build_mask(), expected, rtol=0, atol=0)
    s = layout.seq_len
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, s, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, s, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    base = backend(q, k, v)
    several = expected.sum(dim=1) > 1
    for j in range(s):
        for which in ("k", "v"):
            k2, v2 = k.clone(), v.clone()
            (k2 if which == "k" else v2)[:, j] += torch.randn(2, 8, generator=g, dtype=torch.float64)
            changed = (backend(q, k2, v2) - base).abs().amax(dim=(0, 2, 3)) > 1e-9  # per query position
            sees = expected[:, j] if which == "v" else expected[:, j] & several  # a lone key's score cannot matter
            assert torch.equal(changed, sees), f"{kind}: key {j} perturbed via {which}"
    # text rows never see an image position
    assert not expected[:layout.text_len, layout.text_len:].any()


@pytest.mark.parametrize("kind, opts", CASES)
def test_stable_softmax_is_the_same_attention(kind, opts):
    plain, _ = build_backend(kind, opts)
    stable, layout = build_backend(kind, opts, stable=True)
    q = torch.randn(2, layout.seq_len, 4, 8) * 4
    k, v = torch.randn(2, layout.seq_len, 2, 8) * 4, torch.randn(2, layout.seq_len, 2, 8)
    torch.testing.assert_close(stable(q, k, v), plain(q, k, v), rtol=1e-4, atol=1e-5)


def test_sparse_layout_is_fixed_by_seed_and_layer():
    opts = SparseOptions(block_size=4, local_blocks=2, random_blocks=1)
    table = build_backend("sparse", opts, layer_index=0)[0].block_layout()
    assert (table == build_backend("sparse", opts, layer_index=0)[0].block_layout()).all()  # rebuilt: same
    n = table.shape[0]
    for qb in range(n):
        assert table[qb, max(0, qb - 1):qb + 1].all()  # local window: own block and the one before
        assert not table[qb, qb + 1:].any()  # never a later block
        assert table[qb].sum() <= 2 + 1  # plus at most one random block
    others = [build_backend("sparse", opts, layer_index=i)[0].block_layout() for i in range(1, 6)]
    assert any((other != table).any() for other in others)  # the random blocks are drawn per layer


def test_pattern_backend_refuses_a_language_model_config():
    spec = AttentionSpec(kind="axial_row", dim=16, heads=2, kv_heads=2, head_dim=8, max_seq_len=32)
    with pytest.raises(ConfigError, match="DALL-E image pattern"):
        attention.build(spec)


MODEL_VARIANTS = {
    "plain": {},
    "shift": {"dalle.shift_tokens": True},
    "reversible_shift_stable": {"model.reversible": True, "dalle.shift_tokens": True, "dalle.stable_softmax": True,
                                "model.rotary": False},
}


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
@pytest.mark.parametrize("kind", ["full"] + PATTERNS)
def test_cached_decoding_equals_full_forward(kind, variant):
    model = tiny(**{"dalle.attn_types": kind, **MODEL_VARIANTS[variant]})
    seq = joint_sequence(model)
    full = model.hidden(seq)
    for prefill in (3, TEXT_LEN, 10):
        cache = model.new_cache(2)
        parts = [model.hidden(seq[:, :prefill], cache)]
        parts += [model.hidden(seq[:, i:i + 1], cache) for i in range(prefill, seq.shape[1])]
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
    cache = model.new_cache(2)  # chunked prefill across the text/image boundary
    parts = [model.hidden(seq[:, a:a + 8], cache) for a in range(0, seq.shape[1], 8)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
    cache = model.new_cache(2)  # rewind forgets rejected tokens, attention and token-shift state alike
    model.hidden(seq[:, :12], cache)
    model.hidden(torch.randint(0, K, (2, 4)), cache)
    cache.rewind(4)
    assert cache.length == 12
    torch.testing.assert_close(model.hidden(seq[:, 12:], cache), full[:, 12:], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        cache.rewind(cache.length + 1)


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
@pytest.mark.parametrize("kind", ["full"] + PATTERNS)
def test_model_is_causal_and_text_never_sees_images(kind, variant):
    model = tiny(**{"dalle.attn_types": kind, **MODEL_VARIANTS[variant]})
    seq = joint_sequence(model)
    base = model.hidden(seq)
    for pos in (2, TEXT_LEN + 1, TEXT_LEN + 9):
        other = seq.clone()
        other[:, pos] = (other[:, pos] + 1) % (K if pos >= TEXT_LEN else V)
        out = model.hidden(other)
        torch.testing.assert_close(out[:, :pos], base[:, :pos], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, pos:], base[:, pos:])


@pytest.mark.parametrize("kind", ["full"] + PATTERNS)
def test_gradients_reach_every_trainable_parameter(kind):
    model = tiny(**{"dalle.attn_types": kind, "dalle.shift_tokens": True}).train()
    loss, _ = model(captions(), torch.randint(0, K, (2, M)))
    loss.backward()
    for name, p in model.named_parameters():
        if name.startswith("vae."):
            assert p.grad is None and not p.requires_grad, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_reversible_gradients_equal_plain_autograd():
    """The reversible stack recomputes shifted, shared, pattern layers in its backward pass exactly."""
    model = tiny(**MIXED, **{"model.reversible": True, "dalle.shift_tokens": True, "dalle.shared_ff_ids": "a,b",
                             "model.dropout": 0.1}).train()
    text, codes = captions(), torch.randint(0, K, (2, M))

    def grads():
        model.zero_grad()
        torch.manual_seed(3)
        model(text, codes)[0].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    reversible = grads()
    stack = model.reversible
    model.reversible = lambda x, caches: stack(x, caches, memory_saving=False)
    plain = grads()
    for name in plain:
        torch.testing.assert_close(reversible[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------ model

def test_text_padding_becomes_unique_tokens_after_bos():
    model = tiny()
    text = torch.tensor([[5, 3, 0, 0], [0, 0, 0, 0]])
    prepared = model.prepare_text(text)
    assert prepared.tolist() == [[0, 5, 3, V + 2, V + 3, V + 4, V + 5], [0] + [V + j for j in range(N)]]
    assert model.prepare_text(text[:1], null=torch.tensor([True]))[0].tolist() == prepared[1].tolist()
    with pytest.raises(ValueError, match="exceed dalle.text_seq_len=6"):
        model.prepare_text(torch.ones(1, N + 1, dtype=torch.long))


def test_loss_matches_the_masked_joint_softmax_of_the_original():
    """Two heads on two slices == one (text + image)-way softmax with the other range masked, as the
    original computes it; and the weighting of the two losses."""
    model = tiny(**{"dalle.loss_img_weight": 3.0})
    text, codes = captions(), torch.randint(0, K, (2, M))
    loss, metrics = model(text, codes)
    text_in = model.prepare_text(text)
    h = model.hidden(torch.cat([text_in, codes[:, :-1]], 1))
    joint = torch.cat([model.text_logits(h), model.image_logits(h)], -1)  # (B, N + M, V + N + K)
    is_text = torch.arange(N + M)[:, None] < N
    is_text_logit = torch.arange(joint.shape[-1])[None] < model.num_text_tokens
    joint = joint.masked_fill(is_text != is_text_logit, -torch.finfo(joint.dtype).max)
    labels = torch.cat([text_in[:, 1:], codes + model.num_text_tokens], 1)
    loss_text = F.cross_entropy(joint[:, :N].flatten(0, 1), labels[:, :N].flatten())
    loss_img = F.cross_entropy(joint[:, N:].flatten(0, 1), labels[:, N:].flatten())
    torch.testing.assert_close(metrics["loss_text"], loss_text)
    torch.testing.assert_close(metrics["loss_img"], loss_img)
    torch.testing.assert_close(loss, (loss_text + 3 * loss_img) / 4)
    assert math.isfinite(loss.item())


def test_images_are_encoded_by_the_frozen_dvae():
    model = tiny().train()
    assert not model.vae.training and model.training
    images = torch.rand(3, 3, 16, 16)
    codes = model.vae.get_codebook_indices(images)
    text = captions(3)
    torch.testing.assert_close(model(text, images)[0], model(text, codes)[0])
    with pytest.raises(ValueError, match=r"dVAE takes images of shape \(batch, 3, 16, 16\)"):
        model(text, torch.rand(3, 3, 32, 32))
    with pytest.raises(ValueError, match=r"images \(batch, 3, 16, 16\) or image codes \(batch, 16\)"):
        model(text, codes[:, :5])


class ZeroBranch(torch.nn.Module):
    def forward(self, x, cache=None):
        return torch.zeros_like(x)


def test_shared_ids_share_modules_and_are_stored_once():
    shared = tiny(**{"model.depth": 4, "dalle.attn_types": "full,axial_row", "dalle.shared_attn_ids": "a,b",
                     "dalle.shared_ff_ids": "x"})
    plain = tiny(**{"model.depth": 4, "dalle.attn_types": "full,axial_row"})
    att, ff = shared.layer_attention, shared.layer_ff
    assert att[0] is att[2] and att[1] is att[3] and att[0] is not att[1]
    assert all(f is ff[0] for f in ff)
    assert att[1].inner.name == "axial_row"
    per_attn = sum(p.numel() for p in att[0].parameters())
    per_ff = sum(p.numel() for p in ff[0].parameters())
    assert plain.num_params() - shared.num_params() == 2 * per_attn + 3 * per_ff
    state = shared.state_dict()
    ptrs = [t.data_ptr() for t in state.values()]
    assert len(ptrs) == len(set(ptrs))  # no aliased entries: safetensors can save it
    # a shared weight gets gradient from every layer using it
    text, codes = captions(), torch.randint(0, K, (2, M))
    shared.train()(text, codes)[0].backward()
    grad_total = att[0].q.weight.grad.clone()
    shared.zero_grad()
    shared.blocks[2].attn.fn = ZeroBranch()  # cut layer 2's use: the shared weight's gradient changes
    shared(text, codes)[0].backward()
    assert not torch.allclose(att[0].q.weight.grad, grad_total)


def test_shared_attention_ids_must_keep_one_type():
    with pytest.raises(ConfigError, match="dalle.shared_attn_ids .* must have one type"):
        config(**{"dalle.attn_types": "full,axial_row", "dalle.shared_attn_ids": "a,a"})
    with pytest.raises(ConfigError, match="dalle.attn_types: 'axial' is not a registered"):
        config(**{"dalle.attn_types": "full,axial"})
    with pytest.raises(ConfigError, match="dalle.shared_ff_ids must be a comma-separated list"):
        config(**{"dalle.shared_ff_ids": "a,,b"})


def test_tied_embeddings_and_positions_follow_the_config():
    tied = tiny(**{"model.tie_embeddings": True, "model.rotary": False})
    untied = tiny(**{"model.tie_embeddings": False, "model.rotary": True})
    assert tied.text_head is None and tied.image_head is None and tied.text_pos is not None
    assert untied.image_head.weight.shape == (K, 32) and untied.text_head.weight.shape == (V + N, 32)
    assert untied.text_pos is None and untied.rotary is not None
    h = torch.randn(3, 32)
    torch.testing.assert_close(tied.image_logits(h), h @ tied.image_emb.weight.T)


def test_stable_softmax_keeps_the_loss():
    plain = tiny(**MIXED)
    stable = tiny(**MIXED, **{"dalle.stable_softmax": True})
    stable.load_state_dict(plain.state_dict())
    text, codes = captions(), torch.randint(0, K, (2, M))
    torch.testing.assert_close(stable(text, codes)[0], plain(text, codes)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prob", [0.0, 1.0])
def test_null_conditioning_drops_captions_in_training_only(prob):
    model = tiny(**{"dalle.null_cond_prob": prob})
    text, codes = captions(), torch.randint(0, K, (2, M))
    eval_loss = model.eval()(text, codes)[0]
    null_loss = model(torch.zeros_like(text), codes)[0]
    train_loss = model.train()(text, codes)[0]  # no dropout configured: only the captions can differ
    torch.testing.assert_close(train_loss, null_loss if prob == 1.0 else eval_loss)
    assert not torch.allclose(eval_loss, null_loss)


def test_null_conditioning_drops_about_the_configured_fraction():
    model = tiny(**{"dalle.null_cond_prob": 0.5}).train()
    seen = []
    model.prepare_text = lambda text, null=None, f=model.prepare_text: (seen.append(null), f(text, null))[1]
    torch.manual_seed(0)
    for _ in range(40):
        model(captions(8), torch.randint(0, K, (8, M)))
    dropped = torch.cat(seen).float().mean().item()
    assert 0.35 < dropped < 0.65


def test_export_round_trip_rebuilds_dalle_and_its_dvae(tmp_path):
    from safetensors.torch import load_file

    from efftx.export import WEIGHTS_FILE, export, read_export_config

    torch.manual_seed(5)
    vae = DiscreteVAE(config().vae)  # "trained" weights, given to DALL-E
    cfg0 = config(**MIXED, **{"dalle.shift_tokens": True, "dalle.shared_ff_ids": "a,b"})
    model = DALLE(cfg0.model, cfg0.attention, cfg0.dalle, cfg0.vae, vae=vae).eval()
    assert model.vae is vae and torch.equal(model.vae.codebook.weight, vae.codebook.weight)  # not re-initialised
    export(model, cfg0, tmp_path, {"step": 0})
    cfg, _ = read_export_config(tmp_path)
    assert cfg.vae == cfg0.vae and cfg.dalle == cfg0.dalle
    state = load_file(str(tmp_path / WEIGHTS_FILE))
    assert any(k.startswith("vae.") for k in state)
    rebuilt = models.build(cfg).eval()
    rebuilt.load_state_dict(state, strict=True)
    text = captions()
    a = generate_image_tokens(model, text, cond_scale=2.0, seed=3)
    b = generate_image_tokens(rebuilt, text, cond_scale=2.0, seed=3)
    assert torch.equal(a, b)
    torch.testing.assert_close(rebuilt.vae.decode(a), model.vae.decode(a))
    json.loads((tmp_path / "config.json").read_text())  # plain JSON


def test_a_dvae_with_another_config_is_refused():
    vae = DiscreteVAE(config(**{"vae.num_tokens": 32}).vae)
    with pytest.raises(ConfigError, match="different config than vae"):
        cfg = config()
        DALLE(cfg.model, cfg.attention, cfg.dalle, cfg.vae, vae=vae)


# ------------------------------------------------------------------------------------------ generation

GEN_VARIANTS = {
    "mixed_shift": {**MIXED, "dalle.shift_tokens": True},
    "reversible_stable_shared": {**MIXED, "model.reversible": True, "dalle.stable_softmax": True,
                                 "dalle.shared_attn_ids": "a,b,c,d,e,a,b", "model.depth": 7},
}


@pytest.mark.parametrize("variant", sorted(GEN_VARIANTS))
@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_cached_generation_equals_uncached(variant, cond_scale):
    model = tiny(**GEN_VARIANTS[variant])
    text = captions(2)
    for seed in (0, 1, 2):
        cached = generate_image_tokens(model, text, num_images=2, cond_scale=cond_scale, seed=seed,
                                       filter_thres=0.5, top_p=0.95, temperature=1.2)
        uncached = generate_image_tokens(model, text, num_images=2, cond_scale=cond_scale, seed=seed,
                                         filter_thres=0.5, top_p=0.95, temperature=1.2, use_cache=False)
        assert torch.equal(cached, uncached), seed
    assert not torch.equal(generate_image_tokens(model, text, cond_scale=cond_scale, seed=0),
                           generate_image_tokens(model, text, cond_scale=cond_scale, seed=1))


def test_guidance_mixes_conditional_and_null_logits():
    """cond_scale 0 samples from the null logits alone: the same tokens as an empty caption without guidance."""
    model = tiny(**MIXED)
    text = captions(2)
    null_only = generate_image_tokens(model, text, cond_scale=0.0, seed=4)
    empty = generate_image_tokens(model, torch.zeros_like(text), cond_scale=1.0, seed=4)
    assert torch.equal(null_only, empty)
    assert not torch.equal(generate_image_tokens(model, text, cond_scale=1.0, seed=4), empty)


def test_batch_of_prompts_times_images_per_prompt():
    model = tiny(**MIXED)
    text = captions(3)
    images, codes = generate_images(model, text, num_images=2, seed=0)
    assert codes.shape == (6, M) and codes.dtype == torch.long and 0 <= codes.min() and codes.max() < K
    assert images.shape == (6, 3, 16, 16) and images.min() >= 0 and images.max() <= 1
    # row p * num_images + i is image i of caption p: greedy rows of one caption agree with that caption alone
    greedy = generate_image_tokens(model, text, num_images=2, temperature=0)
    for p in range(3):
        alone = generate_image_tokens(model, text[p:p + 1], temperature=0)
        assert torch.equal(greedy[2 * p], alone[0]) and torch.equal(greedy[2 * p + 1], alone[0])


def test_filter_thres_is_the_originals_top_k():
    assert top_k_of_thres(0.5, 512) == 256
    assert top_k_of_thres(0.9, 512) == 52  # ceil(51.2)
    assert top_k_of_thres(0.7, 10) == 3  # no float creep: (1 - 0.7) * 10 = 3.0000000000000004
    assert top_k_of_thres(1.0, 10) == 1
    # filter_thres near 1 keeps one code: sampling is greedy whatever the seed
    model = tiny()
    text = captions(1)
    assert torch.equal(generate_image_tokens(model, text, filter_thres=0.99, seed=1),
                       generate_image_tokens(model, text, temperature=0))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_images": 0}, "num_images must be >= 1"),
    ({"filter_thres": 1.5}, "filter_thres must be in"),
    ({"top_p": 0.0}, "top_p must be in"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"cond_scale": float("nan")}, "cond_scale must be a finite number"),
])
def test_bad_generation_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_image_tokens(tiny(), captions(1), **kwargs)
    with pytest.raises(ValueError, match=r"caption ids must be integers in \[0, 20\)"):
        generate_image_tokens(tiny(), torch.full((1, 3), V))


@pytest.mark.parametrize("cond_scale", [1.0, 3.0])
def test_per_row_seeds_make_each_image_independent_of_its_batch(cond_scale):
    """One seed per image: a batch of captions draws each image exactly as that caption alone with its
    seed (how the image server batches requests), cached and uncached alike."""
    model = tiny(0)
    text = captions(3, seed=5)
    seeds = [11, 12, 13, 14, 15, 16]  # 3 captions x 2 images
    together = generate_image_tokens(model, text, num_images=2, cond_scale=cond_scale, seed=seeds)
    for p in range(3):
        alone = generate_image_tokens(model, text[p:p + 1], num_images=2, cond_scale=cond_scale,
                                      seed=seeds[2 * p:2 * p + 2])
        assert torch.equal(together[2 * p:2 * p + 2], alone)
    uncached = generate_image_tokens(model, text, num_images=2, cond_scale=cond_scale, seed=seeds, use_cache=False)
    assert torch.equal(together, uncached)
    with pytest.raises(ValueError, match="seed"):
        generate_image_tokens(model, text, num_images=2, seed=[1, 2])
