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
plain GPT and to the first full-attention efftx row, and whether efftx's full-attention LM is within
``--tolerance`` (0.02) nats of the plain GPT.

``--isolate`` trains each row in a fresh process (same batches, same seed), so each row's peak memory is its
own (in one process a row's peak RSS growth is 0 once an earlier, larger row set the peak). ``--wall S`` also
stops every row after S seconds of training: rows then see the same wall budget instead of the same tokens (the
table says how many steps each ran; on a shared machine this budget is only as fair as the load is steady).
``--seeds 0 1 2`` repeats the whole table per seed (model init and batches) and prints each row's mean and range.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
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
    steps: int = 0  # training steps run (fewer than given when a wall budget stopped the row)

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
          weight_decay: float = 0.0, betas=(0.9, 0.99), eval_batch: int = 16, name: str = "",
          wall: float = 0.0) -> Result:
    """A plain AdamW loop at a constant ``lr`` over ``batches`` (stopping after ``wall`` seconds when > 0); the
    held-out loss after the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    model.train()
    cuda = next(model.parameters()).is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss0 = _peak_rss_mb()
    tokens, steps, start = 0, 0, time.perf_counter()
    for rows in batches:
        if wall > 0 and time.perf_counter() - start >= wall:
            break
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        tokens += rows[:, 1:].numel()
        steps += 1
    elapsed = time.perf_counter() - start
    # peak memory: the accelerator's, else growth of the process's peak RSS during this run (0 once an
    # earlier, larger row set the peak: a lower bound, compare rows on a GPU for memory)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else max(_peak_rss_mb() - rss0, 0.0)
    return Result(name, sum(p.numel() for p in model.parameters()), evaluate(model, val, eval_batch),
                  tokens / elapsed, peak, steps)


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


def row_kind(spec: str, model: nn.Module) -> str:
    return "full" if spec == "gpt" else model.attention_cfg.kind


def run_rows(args, seed: int, only: int | None = None) -> list[tuple[Result, str]]:
    """Train the table's rows (``only``: just that row index, 0 = the GPT when present) for one seed."""
    dev = torch.device(args.device)
    data = corpus(args.seq_len)
    batches = [b.to(dev) for b in make_batches(data, args.steps, args.batch, args.seq_len, seed)]
    val = data.val_windows(args.val_windows, args.seq_len).to(dev)
    specs = ([] if args.no_gpt else ["gpt"]) + list(args.recipes)
    rows = []
    for index, spec in enumerate(specs):
        if only is not None and index != only:
            continue
        try:
            model = (build_gpt(build_efftx(args.recipes[0], args.overrides, args.seq_len, seed), args.seq_len, seed)
                     if spec == "gpt" else build_efftx(spec, args.overrides, args.seq_len, seed))
        except ConfigError as exc:
            raise SystemExit(f"bench/learning.py: {spec}: {exc}") from None
        r = train(model.to(dev), batches, val, lr=args.lr, clip=args.clip, weight_decay=args.weight_decay, name=spec,
                  wall=args.wall)
        rows.append((r, row_kind(spec, model)))
        del model
    return rows


def run_isolated(args, argv: list[str], seed: int) -> list[tuple[Result, str]]:
    """Each row in a fresh process of this script (``--row``), so each peak memory is the row's own."""
    n = len(args.recipes) + (0 if args.no_gpt else 1)
    rows = []
    base = [a for a in argv if a != "--isolate"]
    for index in range(n):
        out = subprocess.run([sys.executable, __file__, *base, "--row", str(index), "--row-seed", str(seed)],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"bench/learning.py: row {index} failed:\n{out.stderr[-3000:]}")
        d = json.loads(out.stdout.strip().splitlines()[-1])
        kind = d.pop("kind")
        rows.append((Result(**d), kind))
        print_row(rows[-1][0])
    return rows


def print_row(r: Result) -> None:
    print(f"  {r.name}: {r.val_nats:.4f} nats/byte ({r.val_bpb:.3f} bpb), {r.steps} steps, "
          f"{r.tokens_per_s:,.0f} tokens/s, peak {r.peak_mb:.0f} MiB", flush=True)


def print_table(rows: list[tuple[Result, str]], has_gpt: bool) -> None:
    ref = rows[0][0] if has_gpt else None
    full = next((r for r, kind in rows[1 if has_gpt else 0:] if kind == "full"), None)
    width = max(len(r.name) for r, _ in rows) + 2
    print(f"\n{'row':<{width}}{'params':>11}{'steps':>7}{'val nats/B':>12}{'val bpb':>9}{'vs gpt':>9}"
          f"{'vs full':>9}{'tokens/s':>11}{'x full':>8}{'peak MiB':>10}{'x full':>8}")
    for r, _ in rows:
        gap = f"{r.val_nats - ref.val_nats:+.4f}" if ref is not None else "-"
        fgap = f"{r.val_nats - full.val_nats:+.4f}" if full is not None else "-"
        speed = f"{r.tokens_per_s / full.tokens_per_s:.2f}" if full is not None else "-"
        mem = f"{r.peak_mb / full.peak_mb:.2f}" if full is not None and full.peak_mb > 0 else "-"
        print(f"{r.name:<{width}}{r.params:>11,}{r.steps:>7}{r.val_nats:>12.4f}{r.val_bpb:>9.3f}{gap:>9}{fgap:>9}"
              f"{r.tokens_per_s:>11,.0f}{speed:>8}{r.peak_mb:>10.0f}{mem:>8}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["lm_small"],
                   help="efftx rows: recipe names, each optionally 'recipe:key=value,key=value'")
    p.add_argument("--no-gpt", action="store_true", help="leave out the plain GPT row")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--wall", type=float, default=0.0, help="also stop each row after this many seconds of training")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", help="repeat the table per seed; mean and range per row")
    p.add_argument("--val-windows", type=int, default=64, help="held-out windows evenly spaced over the split")
    p.add_argument("--tolerance", type=float, default=0.02, help="nats/byte a full-attention row may trail the GPT")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="key=value for every efftx row")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--isolate", action="store_true", help="each row in a fresh process (its own peak memory)")
    p.add_argument("--row", type=int, help=argparse.SUPPRESS)  # internal: one row, printed as JSON
    p.add_argument("--row-seed", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.wall < 0:
        raise SystemExit(f"bench/learning.py: --wall must be >= 0, got {args.wall}")

    if args.row is not None:  # a child of --isolate
        (r, kind), = run_rows(args, args.row_seed, only=args.row)
        print(json.dumps({**vars(r), "kind": kind}))
        return 0

    seeds = args.seeds or [args.seed]
    budget = f", at most {args.wall:g} s per row" if args.wall else ""
    print(f"{args.steps} steps x {args.batch} x {args.seq_len} bytes{budget}, AdamW lr {args.lr} (constant), clip "
          f"{args.clip}, weight decay {args.weight_decay}, seeds {seeds}, {args.val_windows} held-out windows, "
          f"{torch.get_num_threads()} threads on {args.device}{', one process per row' if args.isolate else ''}",
          flush=True)
    tables = []
    for seed in seeds:
        if len(seeds) > 1:
            print(f"seed {seed}", flush=True)
        rows = run_isolated(args, argv, seed) if args.isolate else run_rows(args, seed)
        if not args.isolate:
            for r, _ in rows:
                print_row(r)
        print_table(rows, not args.no_gpt)
        tables.append(rows)
    if len(seeds) > 1:
        print(f"\nover seeds {seeds}: val nats/byte mean [min, max]")
        for i, (r, _) in enumerate(tables[0]):
            vals = [t[i][0].val_nats for t in tables]
            print(f"  {r.name}: {sum(vals) / len(vals):.4f} [{min(vals):.4f}, {max(vals):.4f}]")
    rows = tables[0]
    if not args.no_gpt:
        ref = rows[0][0]
        for r in [r for r, kind in rows[1:] if kind == "full"]:
            ok = r.val_nats <= ref.val_nats + args.tolerance
            print(f"goal {'met' if ok else 'NOT met'}: {r.name} is {r.val_nats - ref.val_nats:+.4f} nats/byte from "
                  f"the plain GPT (tolerance {args.tolerance}, seed {seeds[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
