"""Cached decoding tokens/s of efftx vs the seeds' reference packages, at the seed configs (issue 15).

    python bench/decode_reference.py --ref-path /tmp/refpkgs [--families nsa performer sinkhorn]
                                     [--prompt-len 64] [--new-tokens 128] [--rounds 2] [--device cpu]
                                     [--breakdown]

For each family the same architecture and size on both sides (efftx's recipe ``<family>_enwik8``, which mirrors
the seed; the reference built as the seed script builds it, /work/shared/seeds/), random weights, batch 1, the same
random byte prompt, greedy decoding of ``--new-tokens`` tokens: efftx through
:func:`efftx.generation.decode.generate` (prefill + one cached step per token), the reference through its own
generate/sample (native-sparse-attention-pytorch: ``Transformer.sample(..., use_cache_kv=True)``, its cached
decoding; performer-pytorch and sinkhorn-transformer: ``AutoregressiveWrapper.generate``, which has no cache and
runs the whole sequence again per token). tokens/s = new tokens / wall seconds of the whole generation (prefill
included), best of --rounds, both sides of a family measured alternately in this one process. Prints the ratio
efftx / reference with issue 15's goal (at least 2x) marked per family. ``--breakdown`` times one more efftx
generation with hooks on the attention backends and prints their share of it and the ratio's bound with the backends
at no cost (what the rest of the model, shared with dense attention, allows), and the floor no implementation of
these weights in float32 gets under on this machine: one token's matrix-vector products with every ``nn.Linear``
weight of the model alone (batch 1 streams each weight from memory once per token; NSA's compression network,
run once per block, is not counted), with the ratio that floor would give; and one more generation with every
attention backend replaced by the identity on q (no cache writes: the rest of the model's cost measured directly).
Every round also times efftx's decoding with its CPU linear kernel off (every product on ``F.linear``, torch's
BLAS: the column ``F.linear``), side by side; the weight floor is printed for both.
Each generation's thread CPU time is taken too, and the ratios of the best CPU times are printed beside the wall-clock ones: on a
machine shared with other processes they do not count the time this process waited for a core (the goal is judged
on wall clock).

The reference packages are not efftx dependencies: install them into a scratch folder and pass it as --ref-path
(put on sys.path), e.g. ``pip install --no-deps --target /tmp/refpkgs native-sparse-attention-pytorch
performer-pytorch sinkhorn-transformer einops einx jaxtyping frozendict wadler-lindig hyper-connections
local-attention rotary-embedding-torch axial-positional-embedding product-key-memory colt5-attention``. A
reference that cannot be imported or built is reported by name with the error, and its ratio is not measured.
"""

from __future__ import annotations

import argparse
import sys
import time

GOAL = 2.0  # issue 15: efftx's cached decoding at least 2x the reference's tokens/s


def efftx_model(family: str, device: str):
    import torch

    from efftx import recipes
    from efftx.models import build

    cfg = recipes.get(f"{family}_enwik8")
    torch.manual_seed(0)
    return build(cfg).to(device).eval(), cfg


def reference_model(family: str, cfg, device: str):
    """The seed script's model (its constants), eval mode; returns (generate(prompt, n) -> tokens, description)."""
    import torch

    torch.manual_seed(0)
    m = cfg.model
    if family == "nsa":
        from native_sparse_attention_pytorch.compress_networks import GroupedMLP
        from native_sparse_attention_pytorch.transformer import Transformer

        import inspect

        from native_sparse_attention_pytorch.native_sparse_attention import SparseAttention

        o = cfg.attention.nsa
        # the seed names the library's version of its day; later versions renamed or added some arguments
        mlp_args = inspect.signature(GroupedMLP).parameters
        window_key = "compress_block_size" if "compress_block_size" in mlp_args else "compress_window_size"
        mlp = GroupedMLP(dim_head=m.head_dim, heads=m.kv_heads, **{window_key: o.compress_block_size})
        sparse = dict(sliding_window_size=o.sliding_window_size, compress_block_size=o.compress_block_size,
                      compress_mlp=mlp, selection_block_size=o.selection_block_size,
                      num_selected_blocks=o.num_selected_blocks, use_diff_topk=True,
                      interpolated_importance_score=False, query_heads_share_selected_kv=True,
                      compress_block_sliding_stride=o.stride)
        accepted = inspect.signature(SparseAttention).parameters
        sparse = {k: v for k, v in sparse.items() if k in accepted}
        net = Transformer(num_tokens=256, dim=m.dim, depth=m.depth, heads=m.heads, dim_head=m.head_dim,
                          kv_heads=m.kv_heads, use_sparse_attn=True, use_flex_sliding_window=False,
                          use_triton_fine_selection=device == "cuda", use_flex_fine_selection=False,
                          sparse_attn_kwargs=sparse).to(device).eval()

        def generate(prompt, n):
            return net.sample(prompt, prompt.shape[-1] + n, temperature=0.0, use_cache_kv=True)

        return generate, "native-sparse-attention-pytorch Transformer.sample(use_cache_kv=True)"
    if family == "performer":
        from performer_pytorch import PerformerLM
        from performer_pytorch.autoregressive_wrapper import AutoregressiveWrapper

        net = AutoregressiveWrapper(PerformerLM(num_tokens=256, dim=m.dim, depth=m.depth, max_seq_len=m.max_seq_len,
                                                heads=m.heads, causal=True, reversible=True, nb_features=256,
                                                use_scalenorm=True)).to(device).eval()
    elif family == "sinkhorn":
        from sinkhorn_transformer import SinkhornTransformerLM
        from sinkhorn_transformer.autoregressive_wrapper import AutoregressiveWrapper

        net = AutoregressiveWrapper(SinkhornTransformerLM(
            num_tokens=256, emb_dim=128, dim=m.dim, depth=m.depth, max_seq_len=m.max_seq_len, heads=m.heads,
            bucket_size=128, ff_chunks=10, causal=True, reversible=True, attn_dropout=0.1,
            n_local_attn_heads=4)).to(device).eval()
    else:
        raise ValueError(f"unknown family {family!r}")

    def generate(prompt, n):  # their wrappers sample; top-k keeping int(0.005 * 256) = 1 token: greedy (no cache: full re-runs)
        return net.generate(prompt, n, temperature=1.0, filter_thres=0.995)

    return generate, f"{type(net.net).__name__} AutoregressiveWrapper.generate (no cache)"


def backend_share(model, run) -> tuple[float, float]:
    """(wall seconds of ``run()``, seconds of it spent inside the model's attention backends, compression and
    cache writes included), timed with forward hooks on every :class:`efftx.attention.base.AttentionBackend`."""
    import torch

    from efftx.attention.base import AttentionBackend

    spent, start = [0.0], {}
    pre = lambda m, *a: start.__setitem__(id(m), time.perf_counter())  # noqa: E731
    post = lambda m, *a: spent.__setitem__(0, spent[0] + time.perf_counter() - start.pop(id(m)))  # noqa: E731
    backends = [m for m in model.modules() if isinstance(m, AttentionBackend)]
    hooks = [h for m in backends for h in (m.register_forward_pre_hook(pre, with_kwargs=True),
                                           m.register_forward_hook(post, with_kwargs=True))]
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            run()
            return time.perf_counter() - t0, spent[0]
    finally:
        for h in hooks:
            h.remove()


def backends_free(model, run) -> float:
    """Wall seconds of ``run()`` with every attention backend of ``model`` replaced by the identity on q (no cache
    writes, no block compression, positions not advancing): what the rest of the model costs, measured directly."""
    import torch

    from efftx.attention.base import AttentionBackend

    backends = [m for m in model.modules() if isinstance(m, AttentionBackend)]
    for m in backends:
        m.forward = lambda q, k, v, cache=None, x=None: q  # an instance attribute: nn.Module calls it
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            run()
            return time.perf_counter() - t0
    finally:
        for m in backends:
            del m.forward


def weight_floor(model, repeats: int = 20, product=None) -> float:
    """Seconds per token of only the matrix-vector products with every ``nn.Linear`` weight of ``model``, in module
    order, at batch 1 (best of ``repeats``): the weight traffic of one decoding step, no other operation.
    ``product``: the function computing them (default ``F.linear``; efftx's decoding uses its CPU kernel's)."""
    import torch
    import torch.nn.functional as F

    product = product or F.linear

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(1, m.in_features, device=m.weight.device, dtype=m.weight.dtype)
              for m in linears}

    def one_token():
        for m in linears:
            product(inputs[m.in_features], m.weight, m.bias)

    best = float("inf")
    with torch.no_grad():
        one_token()
        for _ in range(repeats):
            t0 = time.perf_counter()
            one_token()
            best = min(best, time.perf_counter() - t0)
    return best


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of ``fn()`` under no_grad."""
    import torch

    with torch.no_grad():
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        return time.perf_counter() - t0, time.thread_time() - c0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref-path", default="/tmp/refpkgs", help="folder holding the reference packages (sys.path)")
    p.add_argument("--families", nargs="+", default=["nsa", "performer", "sinkhorn"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--breakdown", action="store_true",
                   help="also time one more efftx generation split into the attention backends' share and the rest's, "
                        "and print the ratio the family could reach with its backend at no cost, and with every "
                        "operation but the weights' matrix-vector products at no cost")
    args = p.parse_args()
    sys.path.insert(0, args.ref_path)

    import torch

    from efftx.generation.decode import generate
    from efftx.kernels import linear_cpu

    rows, missing, shares = [], [], []
    for family in args.families:
        model, cfg = efftx_model(family, args.device)
        prompt = torch.randint(0, 256, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompt = prompt.to(args.device)
        try:
            ref, what = reference_model(family, cfg, args.device)
            ref(prompt, 2)  # warm-up (and a check that it runs)
        except Exception as e:  # noqa: BLE001 - report any reference that cannot be imported or run
            missing.append((family, f"{type(e).__name__}: {e}"))
            ref, what = None, None
        generate(model, prompt, 2, temperature=0)  # warm-up
        ours, plain, theirs = [], [], []
        for _ in range(args.rounds):
            ours.append(timed(lambda: generate(model, prompt, args.new_tokens, temperature=0)))
            with linear_cpu.disabled():  # the same decoding with every product on F.linear (torch's BLAS)
                plain.append(timed(lambda: generate(model, prompt, args.new_tokens, temperature=0)))
            if ref is not None:
                theirs.append(timed(lambda: ref(prompt, args.new_tokens)))

        def rate(runs, i):  # tokens/s of the best run by wall clock (i = 0) or by thread CPU time (i = 1)
            return args.new_tokens / min(r[i] for r in runs) if runs else None

        rows.append((family, rate(ours, 0), rate(theirs, 0), what, rate(ours, 1), rate(theirs, 1), rate(plain, 0)))
        if args.breakdown:
            total, inside = backend_share(model, lambda: generate(model, prompt, args.new_tokens, temperature=0))
            free = backends_free(model, lambda: generate(model, prompt, args.new_tokens, temperature=0))
            ref_s = min(r[0] for r in theirs) if theirs else None
            floors = (weight_floor(model, product=linear_cpu.linear), weight_floor(model))
            shares.append((family, total, inside, ref_s, floors, free))
        del model

    print(f"cached decoding, batch 1, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy), "
          f"{args.device}, {torch.get_num_threads()} threads; best of {args.rounds} rounds; tokens/s")
    print("efftx: as it decodes (its CPU linear kernel on, efftx.kernels.linear_cpu); F.linear: the same decoding "
          "with every product on torch's F.linear (EFFTX_CPU_LINEAR=off)")
    print(f"{'family':10} {'efftx':>9} {'F.linear':>9} {'reference':>10} {'ratio':>7} {'F.linear':>9}  "
          "reference decoding")
    for family, ours, theirs, what, _, _, plain in rows:
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        plain_ratio = f"{plain / theirs:.2f}x" if theirs else "-"
        print(f"{family:10} {ours:9.1f} {plain:9.1f} {theirs if theirs is None else round(theirs, 1)!s:>10} "
              f"{ratio:>7} {plain_ratio:>9}  {what or 'not measured'}")
    for family, error in missing:
        print(f"reference for {family} could not be imported or run (not measured): {error[:200]}")
    for family, _, _, _, ours_cpu, theirs_cpu, _ in rows:
        if theirs_cpu:
            print(f"{family}: by thread CPU time efftx {ours_cpu / theirs_cpu:.2f}x the reference")
    for family, total, inside, ref_s, (floor, blas_floor), free in shares:
        n = args.new_tokens
        rest = total - inside
        print(f"{family}: efftx {1000 * total / n:.2f} ms/token (prefill included), of it the attention backends "
              f"{1000 * inside / n:.2f} ({inside / total:.0%}), the rest of the model (embedding, norms, q/k/v/o "
              f"projections, rotary, feed-forward, head, sampling) {1000 * rest / n:.2f} ({rest / total:.0%})")
        if ref_s:
            print(f"  bound on the ratio with the attention backends at no cost: {ref_s / rest:.2f}x "
                  f"(the rest of the model alone vs the reference's whole step; timed in a separate pass)")
        print(f"  measured with the attention backends replaced by the identity (no cache writes, no compression): "
              f"{n / free:.1f} tokens/s" + (f", {ref_s / free:.2f}x the reference" if ref_s else ""))
        print(f"  weight floor: one token's matrix-vector products with every Linear weight alone "
              f"{1000 * floor:.2f} ms with efftx's CPU kernel, {1000 * blas_floor:.2f} ms with F.linear "
              f"({blas_floor / floor:.2f}x; the kernel's {floor * n / total:.0%} of an efftx token)"
              + (f"; the ratio with everything else at no cost: {ref_s / n / floor:.2f}x" if ref_s else ""))
    print("goals (issue 15):")
    for family, ours, theirs, *_ in rows:
        name = f"{family} cached decoding at least {GOAL:.0f}x the reference's tokens/s"
        if theirs is None:
            print(f"  [not measured] {name}")
        else:
            print(f"  [{'met' if ours / theirs >= GOAL else 'NOT met'}] {name}: {ours / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
