"""DALL-E: caption tokens then dVAE image tokens, one causal sequence over the language models' Blocks.

With N = ``dalle.text_seq_len``, an f x f token grid (M = f*f image tokens, from the dVAE) and
V = ``model.vocab_size`` (the text vocabulary, pad id 0 included)::

    input    [bos, t_1 .. t_N, c_0 .. c_{M-2}]     N + M positions; the first N + 1 are "text"
    target   [t_1 .. t_N,      c_0 .. c_{M-1}]
    loss     (loss_text + loss_img_weight * loss_img) / (loss_img_weight + 1)

**Text and padding.** Caption ids use 0 for padding (``efftx.data.text_tokens``). Before embedding, the
padding at caption position j becomes the unique token V + j, as in the original DALLE: the model tells
padding from text, and knows where the caption ends, without a mask. ``<bos>`` is id 0 (it no longer
occurs otherwise). The text table has V + N rows and the text head predicts them (padding included, as the
original). Classifier-free guidance drops a caption by making it all padding: with probability
``dalle.null_cond_prob`` per row in training, and as the "null" rows of guided generation.

**Separate logit ranges.** Text positions (the first N) get text logits only, image positions (the last M)
image logits only: two heads on the two slices, which is what the original's masking of one joint
(V + N + K)-way softmax computes, without the masked entries.

**Layers.** ``model.depth`` :class:`~efftx.models.layers.Block` s; layer i's attention is
``dalle.attn_types`` cycled (``full`` or a pattern of :mod:`efftx.attention.patterns`, which receives the
text/image layout through ``spec.options``). Layers whose ``dalle.shared_attn_ids`` (``shared_ff_ids``)
agree share one attention (feed-forward) module; each layer keeps its own norms, and its own cache. Shared
modules are owned by their first layer and reached through :class:`~efftx.models.layers.Shared` by the
others, so the state dict holds each weight once. ``model.reversible`` runs the blocks as a reversible
stack, ``model.activation_checkpointing`` recomputes each block in backward, as for the LMs.

**Positions.** Image tokens always get a learned axial embedding (row + column). Text tokens get a learned
embedding, or with ``model.rotary`` the rotary embedding of the shared layers over the whole sequence
(1-D positions; the original's rotary variant mixes 1-D text and 2-D pixel frequencies: here the axial
embedding carries the 2-D position instead).

**Token shift** (``dalle.shift_tokens``, after the original): before each branch (attention and
feed-forward, after its norm) a text token's first half of features is replaced by the previous token's,
and an image token's first quarter by the token above's and its second quarter by the token to the left's
(zeros at the grid's top row / left column and at position 0). Causal by construction; with a cache, each
layer keeps the normed inputs of both branches (:class:`LayerCache`) so decoding shifts exactly as the full
forward does.

**Stable softmax** (``dalle.stable_softmax``, the seed's fp16 flag): (1) token embeddings pass only 10%
of their gradient (``0.1 * x + 0.9 * x.detach()``; same forward value), (2) the last hidden state is
divided by its (detached) largest magnitude before the final norm, which is scale-invariant, so the
logits are unchanged but fp16 activations stay bounded, (3) pattern layers compute attention with the
explicit scaled-down-logits softmax (:func:`efftx.attention.patterns.stable_attention`); ``full`` layers
run torch's SDPA, which already normalises by the row maximum in fp32.

**The dVAE** sits inside as ``self.vae``: frozen (no gradients, always in eval mode), saved in the state
dict (``vae.*``) and rebuilt from the ``vae`` section of the same config, so one export restores both.

**Dropout**: the seed's ``attn_dropout`` is ``attention.dropout`` (on attention weights), its
``ff_dropout`` is ``model.dropout`` (the blocks' branch outputs, as for the LMs).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from efftx import attention
from efftx.attention.base import AttentionSpec
from efftx.attention.cache import ModelCache
from efftx.attention.patterns import ImageLayout
from efftx.errors import ConfigError
from efftx.models.dvae import DiscreteVAE, numel
from efftx.models.layers import MLP, Attention, Block, Rotary, Shared, make_norm
from efftx.models.lm import LM
from efftx.models.registry import register
from efftx.models.reversible import ReversibleStack, run_blocks


# ---------------------------------------------------------------------------------------------- token shift

def shift_tokens(hist: torch.Tensor, start: int, text_len: int, fmap: int) -> torch.Tensor:
    """Token-shifted features of positions ``[start, T)`` given the features of all positions so far.

    hist (B, T, d): inputs of the branch at positions 0..T-1 -> (B, T - start, d). Text position p takes
    features [0, d/2) from p - 1; image position p (grid cell j = p - text_len) takes [0, d/4) from the
    cell above (p - fmap) and [d/4, d/2) from the cell to the left (p - 1); zeros where there is none.
    """
    _, total, d = hist.shape
    pos = torch.arange(start, total, device=hist.device)  # (t,)
    is_text = pos < text_len
    cell = pos - text_len

    def source(src: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # (t,) positions -> (B, t, d)
        return torch.where(valid[None, :, None], hist[:, src.clamp(min=0)], 0.0)

    prev = source(pos - 1, (pos >= 1) & (is_text | (cell.remainder(fmap) != 0)))
    top = source(pos - fmap, ~is_text & (cell >= fmap))
    ch = torch.arange(d, device=hist.device)
    use_prev = torch.where(is_text[:, None], ch < d // 2, (ch >= d // 4) & (ch < 2 * (d // 4)))  # (t, d)
    use_top = ~is_text[:, None] & (ch < d // 4)
    return torch.where(use_prev, prev, torch.where(use_top, top, hist[:, start:]))


class _History:
    """The inputs one branch has seen: (B, max_len, d), ``length`` valid positions."""

    def __init__(self, batch: int, max_len: int, dim: int, device, dtype):
        self.buf = torch.zeros(batch, max_len, dim, device=device, dtype=dtype)
        self.length = 0

    def append(self, x: torch.Tensor) -> torch.Tensor:
        end = self.length + x.shape[1]
        if end > self.buf.shape[1]:
            raise ValueError(f"token-shift cache overflow: {end} positions > capacity {self.buf.shape[1]}")
        self.buf[:, self.length:end] = x.to(self.buf.dtype)
        self.length = end
        return self.buf[:, :end]

    def rewind(self, n: int) -> None:
        self.length -= n


class LayerCache:
    """Decoding state of one layer with token shift: the attention backend's cache (``attn``) plus the
    normed inputs both branches have seen (``history["attn"]``, ``history["ff"]``)."""

    def __init__(self, attn_cache, batch: int, max_len: int, dim: int, device, dtype):
        self.attn = attn_cache
        self.history = {slot: _History(batch, max_len, dim, device, dtype) for slot in ("attn", "ff")}

    @property
    def length(self) -> int:
        return self.attn.length

    def rewind(self, n: int) -> None:
        self.attn.rewind(n)  # validates n
        for h in self.history.values():
            h.rewind(n)


class TokenShift(nn.Module):
    """Wraps a branch (Attention or MLP): shift its normed input, then call it with the backend cache."""

    def __init__(self, fn: nn.Module, text_len: int, fmap: int, slot: str):
        super().__init__()
        self.fn, self.text_len, self.fmap, self.slot = fn, text_len, fmap, slot

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None):
        if cache is None:
            return self.fn(shift_tokens(x, 0, self.text_len, self.fmap), None)
        hist = cache.history[self.slot].append(x)
        return self.fn(shift_tokens(hist, hist.shape[1] - x.shape[1], self.text_len, self.fmap), cache.attn)


# ---------------------------------------------------------------------------------------------- model

class TokenTable(nn.Embedding):
    """A token embedding that is also the tied output head: ``table(ids)`` looks rows up, ``table(h,
    logits=True)`` is ``h @ W^T``. Both uses go through ``forward``, so ZeRO-3 gathers the weight for each."""

    def forward(self, x: torch.Tensor, logits: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if logits else super().forward(x)


class DALLE(nn.Module):
    """``DALLE(model, attention, dalle, vae_cfg, seed=0, vae=None)``: from the model-only sections of a run config
    (``model.*``, ``attention.*``, ``dalle.*``, ``vae.*``). ``vae``: a trained :class:`DiscreteVAE` whose config
    equals ``vae_cfg`` (default: a fresh one, to be loaded with the weights). ``seed``: as :class:`LM`'s."""

    def __init__(self, model, attention, dalle, vae_cfg, *, seed: int = 0, vae: DiscreteVAE | None = None):
        super().__init__()
        m, dc = model, dalle
        vae_cfg.validate()
        self.model_cfg, self.attention_cfg, self.dalle_cfg, self.vae_cfg, self.seed = model, attention, dalle, vae_cfg, seed
        self.vocab_size = m.vocab_size  # caption ids, 0 = padding
        self.text_seq_len = n = dc.text_seq_len
        self.num_text_tokens = m.vocab_size + n  # + one padding token per caption position
        self.fmap = vae_cfg.fmap_size
        self.image_seq_len = self.fmap ** 2
        self.num_image_tokens = vae_cfg.num_tokens
        self.text_len = n + 1  # <bos> + caption: the text positions
        self.seq_len = self.max_seq_len = n + self.image_seq_len
        self.loss_img_weight = dc.loss_img_weight
        self.null_cond_prob = dc.null_cond_prob
        self.stable = dc.stable_softmax
        self.shift = dc.shift_tokens
        head_dim = m.head_dim or m.dim // m.heads

        self.dim = m.dim
        self.text_emb = TokenTable(self.num_text_tokens, m.dim)
        self.image_emb = TokenTable(self.num_image_tokens, m.dim)
        self.rotary = Rotary(head_dim, self.seq_len, m.rotary_base) if m.rotary else None
        self.text_pos = None if m.rotary else nn.Embedding(self.text_len, m.dim)
        self.image_row = nn.Embedding(self.fmap, m.dim)  # axial image positions
        self.image_col = nn.Embedding(self.fmap, m.dim)
        self.blocks = nn.ModuleList(self._build_blocks())
        self.reversible = ReversibleStack(list(self.blocks)) if m.reversible else None
        self.activation_checkpointing = m.activation_checkpointing  # recompute each block in backward
        self.norm = make_norm(m.norm, m.dim)
        self.text_head = None if m.tie_embeddings else nn.Linear(m.dim, self.num_text_tokens, bias=False)
        self.image_head = None if m.tie_embeddings else nn.Linear(m.dim, self.num_image_tokens, bias=False)
        self.apply(LM._init)  # the LMs' initialisation; before the dVAE joins, so a trained one is untouched

        if vae is None:
            vae = DiscreteVAE(vae_cfg)
        elif vae.cfg != vae_cfg:
            raise ConfigError("the dVAE given to DALL-E has a different config than vae.* of the DALL-E config "
                              "(copy the dVAE export's vae section into the DALL-E config)")
        self.vae = vae.requires_grad_(False).eval()

    def _build_blocks(self) -> list[Block]:
        """One Block per layer of ``dalle.layer_plan``; shared attention / feed-forward modules are owned by
        the first layer of their id. Records each layer's Attention and MLP (``layer_attention``, ``layer_ff``)."""
        m = self.model_cfg
        owned_attn: dict[str, Attention] = {}
        owned_ff: dict[str, MLP] = {}
        self.layer_attention, self.layer_ff, blocks = [], [], []
        for i, (kind, attn_id, ff_id) in enumerate(self.dalle_cfg.layer_plan(m.depth)):
            spec = self._spec(i, kind)
            attn_fn = Shared(owned_attn[attn_id]) if attn_id in owned_attn else owned_attn.setdefault(
                attn_id, Attention(spec, self.rotary, m.dropout))
            ff_fn = Shared(owned_ff[ff_id]) if ff_id in owned_ff else owned_ff.setdefault(
                ff_id, MLP(m.dim, m.mlp_mult, m.dropout, m.ff_chunks))
            if self.shift:
                attn_fn = TokenShift(attn_fn, self.text_len, self.fmap, "attn")
                ff_fn = TokenShift(ff_fn, self.text_len, self.fmap, "ff")
            blocks.append(Block(spec, m.norm, m.mlp_mult, self.rotary, m.dropout, m.ff_chunks,
                                attn_fn=attn_fn, mlp_fn=ff_fn))
            self.layer_attention.append(owned_attn[attn_id])
            self.layer_ff.append(owned_ff[ff_id])
        return blocks

    def _spec(self, layer_index: int, kind: str) -> AttentionSpec:
        spec = AttentionSpec.from_config(self.model_cfg, self.attention_cfg, layer_index=layer_index, kind=kind,
                                         seed=self.seed)
        options = spec.options
        if getattr(attention.get(kind), "requires_image_layout", False):
            options = ImageLayout(self.text_len, self.fmap, self.stable, getattr(self.attention_cfg, kind, None))
        return dataclasses.replace(spec, max_seq_len=self.seq_len, options=options)

    def train(self, mode: bool = True):
        super().train(mode)
        self.vae.eval()  # frozen: its eval behaviour (argmax codes) whatever the mode of DALL-E
        return self

    # ------------------------------------------------------------------ inputs
    def prepare_text(self, text: torch.Tensor, null: torch.Tensor | None = None) -> torch.Tensor:
        """Caption ids (B, L <= text_seq_len), 0 = padding -> the text positions (B, text_seq_len + 1):
        <bos>, then the caption padded to text_seq_len with each padding made the unique token V + j.
        ``null`` (B,) bool: rows whose caption is dropped (all padding)."""
        b, length = text.shape
        if length > self.text_seq_len:
            raise ValueError(f"captions of {length} tokens exceed dalle.text_seq_len={self.text_seq_len}")
        text = F.pad(text, (0, self.text_seq_len - length))
        if null is not None:
            text = text.masked_fill(null[:, None], 0)
        pads = torch.arange(self.text_seq_len, device=text.device) + self.vocab_size
        return F.pad(torch.where(text == 0, pads, text), (1, 0), value=0)

    def image_codes(self, image: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) images in [0, 1] (encoded by the frozen dVAE) or (B, M) code indices -> (B, M) codes."""
        if image.ndim == 4 and image.is_floating_point():
            return self.vae.get_codebook_indices(image)
        if image.ndim == 2 and not image.is_floating_point() and image.shape[1] == self.image_seq_len:
            return image.long()
        raise ValueError(f"DALL-E takes images (batch, {self.vae.channels}, {self.vae.image_size}, "
                         f"{self.vae.image_size}) or image codes (batch, {self.image_seq_len}); got "
                         f"{tuple(image.shape)} {image.dtype}")

    # ------------------------------------------------------------------ transformer
    def embed(self, seq: torch.Tensor, offset: int) -> torch.Tensor:
        """(B, T) ids at positions offset.. -> (B, T, dim): text ids at text positions, codes at image ones."""
        t = seq.shape[1]
        split = min(max(self.text_len - offset, 0), t)  # how many of the positions are text
        parts = []
        if split:
            x = self.text_emb(seq[:, :split])
            if self.text_pos is not None:
                x = x + self.text_pos(torch.arange(offset, offset + split, device=seq.device))
            parts.append(x)
        if split < t:
            cell = torch.arange(offset + split, offset + t, device=seq.device) - self.text_len
            rows, cols = cell.div(self.fmap, rounding_mode="floor"), cell.remainder(self.fmap)
            parts.append(self.image_emb(seq[:, split:]) + self.image_row(rows) + self.image_col(cols))
        x = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if self.stable:
            x = 0.1 * x + 0.9 * x.detach()
        return x

    def hidden(self, seq: torch.Tensor, cache: ModelCache | None = None) -> torch.Tensor:
        """Joint ids (B, T) (see :meth:`embed`) continuing ``cache`` -> final normed hidden states (B, T, dim)."""
        offset = cache.length if cache is not None else 0
        if offset + seq.shape[1] > self.seq_len:
            raise ValueError(f"{offset + seq.shape[1]} positions exceed DALL-E's sequence of {self.seq_len} "
                             f"(text_seq_len + 1 + image tokens - 1)")
        x = self.embed(seq, offset)
        x = run_blocks(x, self.blocks, self.reversible, cache, checkpoint=self.activation_checkpointing)
        if self.stable:
            x = x / x.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
        return self.norm(x)

    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., dim) hidden states of text positions -> (..., V + text_seq_len) text logits."""
        return self.text_emb(h, logits=True) if self.text_head is None else self.text_head(h)

    def image_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., dim) hidden states of image-predicting positions -> (..., num_image_tokens) logits."""
        return self.image_emb(h, logits=True) if self.image_head is None else self.image_head(h)

    def new_cache(self, batch_size: int, max_len: int | None = None) -> ModelCache:
        p = self.text_emb.weight
        max_len = max_len or self.seq_len
        layers = []
        for attn in self.layer_attention:
            c = attn.inner.new_cache(batch_size, max_len, p.device, p.dtype)
            layers.append(LayerCache(c, batch_size, max_len, self.dim, p.device, p.dtype) if self.shift else c)
        return ModelCache(layers)

    # ------------------------------------------------------------------ loss
    def forward(self, text: torch.Tensor, image: torch.Tensor):
        """Training / evaluation loss. text (B, L <= text_seq_len) caption ids, 0 = padding; image: images
        or codes (see :meth:`image_codes`). -> (loss, {"loss_text", "loss_img"} detached). In training mode,
        each caption is dropped with probability ``dalle.null_cond_prob`` (classifier-free guidance)."""
        codes = self.image_codes(image)  # (B, M)
        null = None
        if self.training and self.null_cond_prob > 0:
            null = torch.rand(text.shape[0], device=text.device) < self.null_cond_prob
        text_in = self.prepare_text(text, null)  # (B, N + 1)
        h = self.hidden(torch.cat([text_in, codes[:, :-1]], dim=1))  # (B, N + M, dim)
        n = self.text_seq_len
        text_logits = self.text_logits(h[:, :n]).float()  # (B, N, V + N)
        image_logits = self.image_logits(h[:, n:]).float()  # (B, M, K)
        loss_text = F.cross_entropy(text_logits.flatten(0, 1), text_in[:, 1:].flatten())
        loss_img = F.cross_entropy(image_logits.flatten(0, 1), codes.flatten())
        w = self.loss_img_weight
        loss = (loss_text + w * loss_img) / (w + 1)
        return loss, {"loss_text": loss_text.detach(), "loss_img": loss_img.detach()}

    # ------------------------------------------------------------------ accounting
    def num_params(self) -> int:
        """Trainable parameters (the frozen dVAE is not counted)."""
        return sum(numel(p) for p in self.parameters() if p.requires_grad)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (6 x matmul weights used per token + 12·L·H·D·T attention, as the LMs).
        Shared layers count once per use; heads are averaged over text and image positions; ``seq_len`` is
        DALL-E's own sequence."""
        seq_len = self.seq_len
        n, m = self.text_seq_len, self.image_seq_len
        count = lambda mod: sum(numel(p) for p in mod.parameters())  # noqa: E731
        per_layer = sum(count(a) + count(f) for a, f in zip(self.layer_attention, self.layer_ff))
        heads = self.dim * (self.num_text_tokens * n + self.num_image_tokens * m) / seq_len
        spec = self.layer_attention[0].spec
        return 6 * (per_layer + heads) + 12 * len(self.blocks) * spec.heads * spec.head_dim * seq_len


@register("dalle")
def _build(cfg) -> DALLE:
    return DALLE(cfg.model, cfg.attention, cfg.dalle, cfg.vae, seed=cfg.train.seed)
