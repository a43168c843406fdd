"""Learning per step: efftx's language models against a plain pre-norm GPT, same size, optimizer and batches.

    python bench/learning.py [--recipes lm_small sinkhorn_small ...] [--seq-len 128] [--batch 16] [--steps 200]
                             [--lr 1e-3] [--clip 0.5] [--set model.dim=512 ...] [--threads 2]

Everything runs in this process (no Ray, no DeepSpeed): one plain ``torch.optim.AdamW`` loop at a constant
learning rate with gradient clipping, the same seed, the same training batches (windows of the bundled corpus,
drawn once and replayed for every row) and the same held-out windows. The first row is ``gpt``: a plain GPT
written here (token and learned position embeddings, pre-norm blocks of LayerNorm + causal SDPA + GELU MLP, an
untied output head, PyTorch's default initialisation, as the original implementations use), with the width,
depth, heads and MLP ratio of the first recipe. Each further row is an efftx model built from a recipe's model
sections (``LM(cfg.model, cfg.attention)``), its size given by the recipe and ``--set``.

A row may carry its own overrides: ``lm_small:model.emb_init_std=0.02,model.tie_embeddings=false`` (the controlled
experiments of docs/models.md, "Initialisation and learning per step", are rows of this kind).

Prints held-out loss in nats per byte and bits per byte, tokens/s and peak memory per row with its gap to the
plain GPT, and whether efftx's full-attention LM is within ``--tolerance`` (0.02) nats of the plain GPT.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from efftx import recipes
from efftx.data.bytes import ByteData, prepare
from efftx.errors import ConfigError
from efftx.models.lm import LM
from efftx.paths import home


# ------------------------------------------------------------------------------------------ the plain GPT

class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_mult: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc1, self.fc2 = nn.Linear(dim, int(dim * mlp_mult)), nn.Linear(int(dim * mlp_mult), dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    """A plain pre-norm GPT with PyTorch's default initialisation (the reference of this bench)."""

    def __init__(self, vocab_size: int, dim: int, depth: int, heads: int, mlp_mult: float = 4.0,
                 max_seq_len: int = 1024):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not a multiple of heads={heads}")
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads, mlp_mult) for _ in range(depth))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# ------------------------------------------------------------------------------------------ one training run

@dataclass
class Result:
    name: str
    params: int
    val_nats: float  # held-out cross-entropy, nats per byte (one token = one byte)
    tokens_per_s: float
    peak_mb: float

    @property
    def val_bpb(self) -> float:
        return self.val_nats / math.log(2)


def corpus(seq_len: int, cache_dir: str | None = None) -> ByteData:
    """The bundled corpus, cached where runs cache it (data.cache_dir's default: <efftx home>/data)."""
    return ByteData(prepare("bundled", cache_dir or home() / "data", seq_len))


def make_batches(data: ByteData, steps: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """The training batches, drawn once: every row replays the same list."""
    rng = np.random.default_rng(seed)
    return [data.train_batch(batch, seq_len, rng) for _ in range(steps)]


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, batch: int) -> float:
    model.eval()
    total, n = 0.0, 0
    for rows in val.split(batch):
        logits = model(rows[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum").item()
        n += rows[:, 1:].numel()
    model.train()
    return total / n


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train(model: nn.Module, batches: list[torch.Tensor], val: torch.Tensor, *, lr: float, clip: float,
          weight_decay: float = 0.0, betas=(0.9, 0.99), eval_batch: int = 16, name: str = "") -> Result:
    """A plain AdamW loop at a constant ``lr`` over ``batches``; the held-out loss after the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    model.train()
    cuda = next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss0 = _peak_rss_mb()
    tokens, start = 0, time.perf_counter()
    for rows in batches:
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        tokens += rows[:, 1:].numel()
    elapsed = time.perf_counter() - start
    # peak memory: the accelerator's, else growth of the process's peak RSS during this run (0 once an
    # earlier, larger row set the peak: a lower bound, compare rows on a GPU for memory)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else max(_peak_rss_mb() - rss0, 0.0)
    return Result(name, sum(p.numel() for p in model.parameters()), evaluate(model, val, eval_batch),
                  tokens / elapsed, peak)


# ------------------------------------------------------------------------------------------ rows

def parse_row(spec: str) -> tuple[str, list[str]]:
    """``recipe`` or ``recipe:key=value,key=value`` -> (recipe, overrides)."""
    name, _, rest = spec.partition(":")
    return name, [kv for kv in rest.split(",") if kv]


def build_efftx(spec: str, overrides: list[str], seq_len: int, seed: int) -> LM:
    name, own = parse_row(spec)
    cfg = recipes.get(name).override(overrides).override(own)
    if cfg.model.family != "lm":
        raise SystemExit(f"{spec}: model.family={cfg.model.family!r}; this bench trains language models (family lm)")
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq_len)
    cfg.name = cfg.name or f"learning-{name}"
    cfg.validate()
    torch.manual_seed(seed)
    return LM(cfg.model, cfg.attention, seed=seed)


def build_gpt(like: LM, seq_len: int, seed: int) -> PlainGPT:
    m = like.model_cfg
    torch.manual_seed(seed)
    return PlainGPT(m.vocab_size, m.dim, m.depth, m.heads, m.mlp_mult, max(m.max_seq_len, seq_len))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["lm_small"],
                   help="efftx rows: recipe names, each optionally 'recipe:key=value,key=value'")
    p.add_argument("--no-gpt", action="store_true", help="leave out the plain GPT row")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-windows", type=int, default=64, help="held-out windows evenly spaced over the split")
    p.add_argument("--tolerance", type=float, default=0.02, help="nats/byte a full-attention row may trail the GPT")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="key=value for every efftx row")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)

    data = corpus(args.seq_len)
    batches = [b.to(dev) for b in make_batches(data, args.steps, args.batch, args.seq_len, args.seed)]
    val = data.val_windows(args.val_windows, args.seq_len).to(dev)
    print(f"{args.steps} steps x {args.batch} x {args.seq_len} bytes, AdamW lr {args.lr} (constant), clip "
          f"{args.clip}, weight decay {args.weight_decay}, seed {args.seed}, {args.val_windows} held-out windows, "
          f"{torch.get_num_threads()} threads on {dev}", flush=True)

    rows: list[tuple[Result, str]] = []
    try:
        models = [(spec, build_efftx(spec, args.overrides, args.seq_len, args.seed)) for spec in args.recipes]
    except ConfigError as exc:
        raise SystemExit(f"bench/learning.py: {exc}") from None
    if not args.no_gpt:
        models.insert(0, ("gpt", build_gpt(models[0][1], args.seq_len, args.seed)))
    for spec, model in models:
        kind = "full" if spec == "gpt" else model.attention_cfg.kind
        r = train(model.to(dev), batches, val, lr=args.lr, clip=args.clip, weight_decay=args.weight_decay, name=spec)
        rows.append((r, kind))
        print(f"  {spec}: {r.val_nats:.4f} nats/byte ({r.val_bpb:.3f} bpb), {r.tokens_per_s:,.0f} tokens/s",
              flush=True)
        del model

    ref = rows[0][0] if not args.no_gpt else None
    width = max(len(r.name) for r, _ in rows) + 2
    print(f"\n{'row':<{width}}{'params':>11}{'val nats/B':>12}{'val bpb':>9}{'vs gpt':>9}{'tokens/s':>11}"
          f"{'peak MiB':>10}")
    for r, _ in rows:
        gap = f"{r.val_nats - ref.val_nats:+.4f}" if ref is not None else "-"
        print(f"{r.name:<{width}}{r.params:>11,}{r.val_nats:>12.4f}{r.val_bpb:>9.3f}{gap:>9}"
              f"{r.tokens_per_s:>11,.0f}{r.peak_mb:>10.0f}")
    full = [r for r, kind in rows[1:] if kind == "full"] if ref is not None else []
    for r in full:
        ok = r.val_nats <= ref.val_nats + args.tolerance
        print(f"goal {'met' if ok else 'NOT met'}: {r.name} is {r.val_nats - ref.val_nats:+.4f} nats/byte from the "
              f"plain GPT (tolerance {args.tolerance})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
