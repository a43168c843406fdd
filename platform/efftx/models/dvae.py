"""Discrete VAE: images <-> a grid of codebook indices, the image vocabulary of DALL-E.

    images (B, C, S, S) in [0, 1] -> (x - mean) / std -> conv encoder -> logits (B, K, f, f),  f = S / 2**num_layers
      training:    Gumbel-softmax over the K codes at temperature(step) (hard one-hot forward with
                   straight_through, soft gradients backward)
      evaluation:  one-hot of the argmax (deterministic: what DALL-E sees)
    -> mixture of codebook vectors (B, codebook_dim, f, f) -> conv decoder -> reconstruction (normalised space)

    loss = recon(normalised images, reconstruction) + kl_weight * KL(q(code | image) || uniform)

``recon`` is MSE or smooth-L1 (``vae.recon_loss``); KL is summed over the f*f positions and averaged over
the batch, as the original. Encoder: ``num_layers`` stride-2 4x4 convolutions (each halves the side) with
ReLU, then ``num_resnet_blocks`` residual blocks and a 1x1 convolution to the K code logits; the decoder
mirrors it with transposed convolutions and ends in a 1x1 convolution to the image channels.

All configuration is ``vae.*`` (:class:`efftx.config.VAEConfig`); the model is rebuilt from it alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from efftx.config import VAEConfig
from efftx.models.registry import numel, register


def temperature(vc: VAEConfig, step: int) -> float:
    """Gumbel-softmax temperature at optimizer step ``step``: exponential decay from ``vae.temperature`` at
    rate ``vae.temperature_anneal``, floored at ``vae.temperature_min`` (the original recomputed it every
    100 steps; here it is a smooth function of the step)."""
    return max(vc.temperature * math.exp(-vc.temperature_anneal * step), vc.temperature_min)


def codebook_usage(indices: torch.Tensor, num_tokens: int) -> dict[str, torch.Tensor]:
    """Usage of the codebook by a batch of code indices (any shape): the perplexity of the code histogram
    (exp of its entropy: 1 = one code used, ``num_tokens`` = all used equally) and the number of codes
    never used ("dead"). 0-d float tensors, computed without a host sync."""
    flat = indices.reshape(-1)
    counts = torch.zeros(num_tokens, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float))
    p = counts / counts.sum().clamp(min=1)
    entropy = -torch.special.xlogy(p, p).sum()
    return {"perplexity": entropy.exp(), "dead_codes": (counts == 0).sum().float()}


class ResBlock(nn.Module):
    """x + conv1x1(relu(conv3x3(relu(conv3x3(x)))))."""

    def __init__(self, channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 1),
        )

    def forward(self, x):
        return x + self.net(x)


class Codebook(nn.Module):
    """K x codebook_dim vectors. ``codebook(indices)`` (B, n) long -> (B, n, d) vectors; ``codebook(codes)``
    (B, K, f, f) one-hot or soft codes -> (B, d, f, f) mixtures. Both go through ``forward``, so an engine
    that gathers a module's weights around its forward (ZeRO-3) sees every use."""

    def __init__(self, num_tokens: int, dim: int):
        super().__init__()
        self.embedding_dim = dim
        self.weight = nn.Parameter(torch.randn(num_tokens, dim))  # N(0, 1), as nn.Embedding

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.is_floating_point():
            return torch.einsum("bkhw,kd->bdhw", codes, self.weight)
        return F.embedding(codes, self.weight)


class DiscreteVAE(nn.Module):
    def __init__(self, vc: VAEConfig):
        super().__init__()
        vc.validate()
        self.cfg = vc
        self.image_size, self.channels, self.num_tokens = vc.image_size, vc.channels, vc.num_tokens
        self.fmap_size = vc.fmap_size
        h, res = vc.hidden_dim, [ResBlock(vc.hidden_dim) for _ in range(vc.num_resnet_blocks)]

        encoder, ch = [], vc.channels
        for _ in range(vc.num_layers):
            encoder += [nn.Conv2d(ch, h, 4, stride=2, padding=1), nn.ReLU()]
            ch = h
        self.encoder = nn.Sequential(*encoder, *res, nn.Conv2d(h, vc.num_tokens, 1))  # -> (B, K, f, f)

        decoder, ch = [], vc.codebook_dim
        if vc.num_resnet_blocks:
            decoder += [nn.Conv2d(vc.codebook_dim, h, 1), *[ResBlock(h) for _ in range(vc.num_resnet_blocks)]]
            ch = h
        for _ in range(vc.num_layers):
            decoder += [nn.ConvTranspose2d(ch, h, 4, stride=2, padding=1), nn.ReLU()]
            ch = h
        self.decoder = nn.Sequential(*decoder, nn.Conv2d(h, vc.channels, 1))  # -> (B, C, S, S)

        self.codebook = Codebook(vc.num_tokens, vc.codebook_dim)
        means, stds = vc.normalization()
        # from the config, so not persistent: the weights file holds weights only
        self.register_buffer("means", torch.tensor(means).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("stds", torch.tensor(stds).view(1, -1, 1, 1), persistent=False)

    # ------------------------------------------------------------------ pieces
    def _check(self, images: torch.Tensor) -> None:
        want = (self.channels, self.image_size, self.image_size)
        if images.ndim != 4 or tuple(images.shape[1:]) != want:
            raise ValueError(f"the dVAE takes images of shape (batch, {want[0]}, {want[1]}, {want[2]}) "
                             f"(vae.channels, vae.image_size); got {tuple(images.shape)}")

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        # in the images' dtype: a bf16/fp16 DeepSpeed engine casts the parameters, not the buffers (kept fp32), and
        # fp32 statistics would promote a half batch to fp32 before the half convolutions
        return (images - self.means.to(images.dtype)) / self.stds.to(images.dtype)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.stds.to(x.dtype) + self.means.to(x.dtype)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) images in [0, 1] -> (B, K, f, f) code logits. Images are cast to the weights' dtype
        (a bf16/fp16 engine does not cast inputs)."""
        self._check(images)
        return self.encoder(self.normalize(images.to(self.codebook.weight.dtype)))

    def decode_onehot(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, K, f, f) one-hot or soft codes -> (B, C, S, S) reconstruction, normalised space."""
        return self.decoder(self.codebook(codes))  # codebook mixture (B, codebook_dim, f, f) -> images

    # ------------------------------------------------------------------ training
    def forward(self, images: torch.Tensor, temperature: float | None = None):
        """-> (loss, metrics): reconstruction + weighted KL. ``temperature`` defaults to ``vae.temperature``;
        pass :func:`temperature` (cfg, step) while training. Metrics are detached 0-d tensors: recon_loss,
        kl, and the codebook usage of this batch's argmax codes (perplexity, dead_codes)."""
        vc = self.cfg
        logits = self.logits(images)  # (B, K, f, f)
        if self.training:
            tau = vc.temperature if temperature is None else temperature
            codes = F.gumbel_softmax(logits, tau=tau, hard=vc.straight_through, dim=1)
        else:
            codes = F.one_hot(logits.argmax(1), self.num_tokens).permute(0, 3, 1, 2).to(logits.dtype)
        recon = self.decode_onehot(codes)
        target = self.normalize(images)
        recon_fn = F.smooth_l1_loss if vc.recon_loss == "smooth_l1" else F.mse_loss
        recon_loss = recon_fn(recon.float(), target.float())
        log_q = F.log_softmax(logits.float(), dim=1)  # (B, K, f, f)
        kl = (log_q.exp() * (log_q + math.log(self.num_tokens))).sum() / images.shape[0]
        loss = recon_loss + vc.kl_weight * kl
        usage = codebook_usage(logits.detach().argmax(1), self.num_tokens)
        return loss, {"recon_loss": recon_loss.detach(), "kl": kl.detach(), **usage}

    # ------------------------------------------------------------------ codes <-> images
    @torch.no_grad()
    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) images in [0, 1] -> (B, f*f) long code indices, row-major over the token grid."""
        return self.logits(images).argmax(1).flatten(1)

    @torch.no_grad()
    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """(B, f*f) code indices -> (B, C, S, S) images in [0, 1]."""
        f = self.fmap_size
        if indices.ndim != 2 or indices.shape[1] != f * f:
            raise ValueError(f"decode takes (batch, {f * f}) code indices ({f}x{f} grid); got {tuple(indices.shape)}")
        z = self.codebook(indices).view(indices.shape[0], f, f, -1).permute(0, 3, 1, 2)  # (B, d, f, f)
        return self.denormalize(self.decoder(z)).clamp(0, 1)

    @torch.no_grad()
    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        """Images through their codes and back: what DALL-E's image tokens can express."""
        return self.decode(self.get_codebook_indices(images))

    # ------------------------------------------------------------------ accounting
    def num_params(self) -> int:
        return sum(numel(p) for p in self.parameters())

    def flops_per_image(self) -> float:
        """Training FLOPs per image: 6 x multiply-accumulates of the convolutions and the codebook mixing."""
        def conv_macs(seq: nn.Sequential, res: int) -> tuple[int, int]:
            macs = 0
            for m in seq.modules():
                k = m.kernel_size[0] * m.kernel_size[1] if isinstance(m, nn.Conv2d | nn.ConvTranspose2d) else 0
                if isinstance(m, nn.ConvTranspose2d):  # cost at the input resolution, then upsample
                    macs += m.in_channels * m.out_channels * k * res * res
                    res *= m.stride[0]
                elif isinstance(m, nn.Conv2d):
                    res //= m.stride[0]
                    macs += m.in_channels * m.out_channels * k * res * res
            return macs, res

        enc, f = conv_macs(self.encoder, self.image_size)
        dec, _ = conv_macs(self.decoder, f)
        mix = self.num_tokens * self.codebook.embedding_dim * f * f
        return 6.0 * (enc + dec + mix)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """The train loop's MFU hook; a dVAE's unit of work is one image (``seq_len`` is not used)."""
        return self.flops_per_image()


@register("dvae")
def _build(cfg) -> DiscreteVAE:
    return DiscreteVAE(cfg.vae)
