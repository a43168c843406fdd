"""NSA cached decoding over ragged rows (issue 15): each row of a batched cache at its own position gives the
uncached forward of that row alone, through prefills of different lengths, steps, per-row rewinds, query chunks of
the decoding path, and rows split and joined (continuous batching)."""

from __future__ import annotations

import pytest
import torch

from efftx import recipes
from efftx.attention import nsa
from efftx.attention.nsa import NSACache
from rows_check import check_split_and_join  # tests/rows_check.py
from efftx.models import build as build_model
from test_nsa import OPTION_CASES, inputs, make  # tests/test_nsa.py


def _decode_ragged(backend, q, k, v, x, prompts, steps, rewinds=(), dtype=torch.float32):
    """Feed row b its first prompts[b] tokens (one padded prefill, the padding rewound, as Rows.prefill does), then
    ``steps`` (tokens per call) at each row's own position; ``rewinds`` (after call i, counts per row). Returns each
    row's output per position (a dict position -> (H, D), the latest write of a position winning)."""
    b, t = q.shape[:2]
    cache = backend.new_cache(b, t, torch.device("cpu"), dtype)
    longest = max(prompts)
    got = [dict() for _ in range(b)]
    out = backend(q[:, :longest], k[:, :longest], v[:, :longest], cache=cache, x=x[:, :longest])
    for r in range(b):
        for p in range(prompts[r]):
            got[r][p] = out[r, p]
    cache.rewind([longest - n for n in prompts])
    assert cache.lengths == list(prompts)
    for i, n in enumerate(steps):
        start = list(cache.lengths)
        if max(start) + n > t:
            break
        take = lambda z: torch.stack([z[r, s:s + n] for r, s in enumerate(start)])  # noqa: E731
        out = backend(take(q), take(k), take(v), cache=cache, x=take(x))
        for r, s in enumerate(start):
            for j in range(n):
                got[r][s + j] = out[r, j]
        if i in dict(rewinds):
            cache.rewind(dict(rewinds)[i])
    return got, cache


def _assert_rows_equal_alone(backend, q, k, v, x, got):
    for r, row in enumerate(got):
        want = backend(q[r:r + 1], k[r:r + 1], v[r:r + 1], x=x[r:r + 1])[0]  # the row alone, uncached
        pos = sorted(row)
        torch.testing.assert_close(torch.stack([row[p] for p in pos]), want[pos], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"row {r}: {m}")


@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_ragged_rows_decode_as_each_row_alone(options):
    """Three rows with prompts of 3, 9 and 17 tokens (block boundaries at 8 and 4 x k), steps of 1 and 2 tokens,
    then per-row rewinds (one row not at all, one across a compressed block) and the tokens fed again."""
    backend = make(block=8, stride=4, sel=8, n_sel=4, window=6, **options)
    q, k, v, x = inputs(40, b=3)
    with torch.no_grad():
        got, cache = _decode_ragged(backend, q, k, v, x, [3, 9, 17], [1, 2, 1, 2, 2, 1, 2, 1, 1, 2, 1],
                                    rewinds=[(4, [3, 0, 5]), (8, [1, 2, 0])])
        _assert_rows_equal_alone(backend, q, k, v, x, got)
    assert isinstance(cache, NSACache) and len(set(cache.lengths)) > 1


@pytest.mark.parametrize("geometry", [(16, 8, 8, 4, 12), (4, 4, 8, 4, 5), (16, 16, 16, 3, 20)], ids=str)
@pytest.mark.parametrize("options", [{}, {"share_selection": False, "compress_mem_kv": 1},
                                     {"importance": "logits_softmax", "min_importance": 1e-10, "compress_mem_kv": 1},
                                     {"separate_kv": True, "score_mapping": "eq9", "num_initial_blocks": 1,
                                      "num_local_blocks": 2}], ids=["default", "per_head_mem", "seed", "paper"])
def test_ragged_rows_other_geometries_and_query_chunks(geometry, options, monkeypatch):
    """Overlapping and unequal block geometries; calls of up to 5 tokens in decoding chunks of 2 queries (the
    chunk loop of the decoding path), a ragged call larger than a chunk included."""
    monkeypatch.setattr(nsa, "DECODE_QUERIES", 2)
    block, stride, sel, n_sel, window = geometry
    backend = make(block=block, stride=stride, sel=sel, n_sel=n_sel, window=window, **options)
    q, k, v, x = inputs(64, b=3)
    with torch.no_grad():
        got, _ = _decode_ragged(backend, q, k, v, x, [1, 14, 33], [5, 1, 3, 1, 4, 2, 1, 5],
                                rewinds=[(2, [2, 3, 1])])
        _assert_rows_equal_alone(backend, q, k, v, x, got)


def test_seed_geometry_long_context_steps_equal_the_chunked_forward():
    """The seed's blocks (16/16/16, 4 selected, window 64) at 300 tokens: single-token steps of two rows 37 tokens
    apart read dozens of compressed blocks and give the chunked forward's outputs."""
    backend = make(heads=4, kv_heads=2, head_dim=16, block=16, stride=16, sel=16, n_sel=4, window=64,
                   importance="logits_softmax", min_importance=1e-10, compress_mem_kv=1)
    q, k, v, x = inputs(300, head_dim=16, b=2)
    with torch.no_grad():
        got, _ = _decode_ragged(backend, q, k, v, x, [263, 226], [1] * 37)
        got = [{p: o for p, o in row.items() if p >= 226} for row in got]
        _assert_rows_equal_alone(backend, q, k, v, x, got)


def test_cache_rows_are_ragged_and_every_tensor_is_one_entry_per_row():
    backend = make(separate_kv=True, compress_mem_kv=2)
    cache = backend.new_cache(3, 20, torch.device("cpu"), torch.float32)
    tensors = {n: t for n, t in vars(cache).items() if isinstance(t, torch.Tensor)}
    assert {"k", "v", "k_cmp", "v_cmp", "k_win", "v_win", "ck", "cv", "row_pos"} <= set(tensors)
    assert all(t.shape[0] == 3 for t in tensors.values())
    assert cache.k.shape[2] == 24  # 20 tokens rounded up to whole selection blocks (8)
    q, k, v, x = inputs(20, b=3)
    with torch.no_grad():
        backend(q[:, :7], k[:, :7], v[:, :7], cache=cache, x=x[:, :7])
    cache.rewind([0, 2, 5])
    assert cache.lengths == [7, 5, 2] and cache.row_pos.tolist() == [7, 5, 2]
    assert cache.offset().tolist() == [[7], [5], [2]]
    with pytest.raises(ValueError, match="overflow"):
        with torch.no_grad():
            backend(q[:, :14], k[:, :14], v[:, :14], cache=cache, x=x[:, :14])
    with pytest.raises(ValueError, match="2 rows of keys for an nsa cache of 3 rows"):
        cache.write(k[:2, :1], v[:2, :1], (k[:2, :1], v[:2, :1]), (k[:2, :1], v[:2, :1]))


def _lm(seed=0, **nsa_options):
    cfg = recipes.get("lm_debug").override({
        "model.depth": 2, "attention.kind": "nsa", "attention.nsa.compress_block_size": 4,
        "attention.nsa.compress_stride": 2, "attention.nsa.selection_block_size": 4,
        "attention.nsa.num_selected_blocks": 2, "attention.nsa.sliding_window_size": 6,
        "attention.nsa.compress_mlp_mult": 0.5, **{f"attention.nsa.{k}": v for k, v in nsa_options.items()}})
    torch.manual_seed(seed)
    return build_model(cfg).eval()


@pytest.mark.parametrize("options", [{}, {"separate_kv": True, "compress_mem_kv": 1, "share_selection": False,
                                          "importance": "logits_softmax", "min_importance": 1e-10}],
                         ids=["default", "separate_mem_per_head_logits"])
def test_rows_split_and_joined_decode_as_the_rows_alone(options):
    """splittable(nsa model) holds; rows taken out of a batched state (Rows.select), joined with another batch
    (Rows.concat) and rewound per row give, step by step, the logits each row gets decoding alone."""
    check_split_and_join(_lm(**options), lengths=(5, 11, 2, 8), before=(3, 2), joined=7, rewind=(1, 0, 2),
                         rewind_after=3, full=False)


@pytest.mark.parametrize("options", [{}, {"separate_kv": True, "share_selection": False},
                                     {"importance": "logits_softmax", "min_importance": 1e-10, "compress_mem_kv": 1}],
                         ids=["default", "separate_per_head", "seed"])
def test_equal_rows_steps_with_one_backend_over_caches_of_other_sizes(options):
    """Rows of equal length (the decoding path's window read as one slice of the cache) stepping 1-3 tokens from
    positions before and after the window fills, one backend decoding into caches of other batch sizes and
    capacities in turn (the index tensors it reuses across steps must follow the cache)."""
    backend = make(block=8, stride=4, sel=8, n_sel=3, window=6, **options)
    q, k, v, x = inputs(44, b=3)
    with torch.no_grad():
        for rows, cap, prompt, steps in [(3, 44, 2, [1, 3, 1, 2, 1, 1]), (3, 30, 9, [1, 1, 2, 3, 1]),
                                         (2, 44, 5, [2, 1, 1, 1, 3, 1])]:
            want = backend(q[:rows, :cap], k[:rows, :cap], v[:rows, :cap], x=x[:rows, :cap])
            cache = backend.new_cache(rows, cap, torch.device("cpu"), torch.float32)
            got = [backend(q[:rows, :prompt], k[:rows, :prompt], v[:rows, :prompt], cache=cache,
                           x=x[:rows, :prompt])]
            at = prompt
            for n in steps * 4:
                if at + n > cap:
                    break
                got.append(backend(q[:rows, at:at + n], k[:rows, at:at + n], v[:rows, at:at + n], cache=cache,
                                   x=x[:rows, at:at + n]))
                at += n
            torch.testing.assert_close(torch.cat(got, 1), want[:, :at], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{rows} rows, capacity {cap}: {m}")


# ------------------------------------------------------------------------------ the fused C++ decoding kernel
# (block = stride = selection block, n_sel, window) x options the kernel covers: the identity score mapping, one
# selection per kv head; memory slots, both importances, min_importance thresholds that bite, forced blocks and
# the window branch's own projection
KERNEL_GEOMETRIES = [(4, 3, 5), (8, 2, 12), (16, 4, 40)]
KERNEL_OPTIONS = [{}, {"compress_mem_kv": 2}, {"importance": "logits_softmax", "min_importance": 1e-10,
                                               "compress_mem_kv": 1},
                  {"min_importance": 0.3}, {"num_initial_blocks": 1, "num_local_blocks": 2, "separate_kv": True},
                  {"importance": "logits_softmax", "min_importance": 0.2, "num_local_blocks": 3}]
KERNEL_HEADS = [(4, 2, 8), (4, 4, 8), (8, 2, 16), (6, 1, 4)]  # heads, kv heads, head dim: groups of 2, 1, 4, 6


def _no_torch_decoding(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the torch decoding path ran where the fused kernel should have")

    monkeypatch.setattr(nsa.NativeSparseAttention, "decode", refuse)


@pytest.mark.parametrize("geometry", KERNEL_GEOMETRIES, ids=str)
@pytest.mark.parametrize("options", KERNEL_OPTIONS, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_fused_decoding_kernel_equals_the_torch_decoding(geometry, options, monkeypatch):
    """Ragged rows (prompts of 1, 6, 19 and 30 tokens) stepping 1 to 5 queries per call with per-row rewinds: the
    kernel (cpu_kernel=on; the torch path refused) gives the outputs of NativeSparseAttention.decode, its
    reference (cpu_kernel=off), and so each row's uncached forward alone."""
    block, n_sel, window = geometry
    i = KERNEL_GEOMETRIES.index(geometry) + KERNEL_OPTIONS.index(options)
    heads, kv_heads, head_dim = KERNEL_HEADS[i % len(KERNEL_HEADS)]
    backend = make(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block=block, stride=block, sel=block,
                   n_sel=n_sel, window=window, **options)
    q, k, v, x = inputs(60, heads=heads, kv_heads=kv_heads, head_dim=head_dim, b=4)
    args = (backend, q, k, v, x, [1, 6, 19, 30], [1, 5, 1, 3, 1, 1, 2, 4, 1, 1, 1, 2, 1, 5, 1, 1, 3, 1])
    rewinds = [(3, [2, 0, 5, 1]), (9, [0, 3, 1, 4])]
    with torch.no_grad():
        backend.cpu_kernel = "off"
        want, _ = _decode_ragged(*args, rewinds=rewinds)
        backend.cpu_kernel = "on"
        with monkeypatch.context() as m:
            _no_torch_decoding(m)
            got, _ = _decode_ragged(*args, rewinds=rewinds)
    for r, (row, ref) in enumerate(zip(got, want)):
        assert sorted(row) == sorted(ref)
        pos = sorted(row)
        torch.testing.assert_close(torch.stack([row[p] for p in pos]), torch.stack([ref[p] for p in pos]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"row {r}: {m}")
    _assert_rows_equal_alone(backend, q, k, v, x, got)


def test_fused_decoding_kernel_in_float64_and_at_the_seed_geometry(monkeypatch):
    """float64 (the kernel's other type) at the seed's settings (blocks of 16, 4 selected, window 64, one memory
    slot, logits_softmax importances) over 200 tokens: equal to the torch decoding to float64 rounding."""
    backend = make(heads=4, kv_heads=2, head_dim=16, block=16, stride=16, sel=16, n_sel=4, window=64,
                   importance="logits_softmax", min_importance=1e-10, compress_mem_kv=1).double()
    q, k, v, x = inputs(200, head_dim=16, b=2, dtype=torch.float64)
    args = (backend, q, k, v, x, [150, 37], [1] * 30 + [3] * 10)
    with torch.no_grad():
        backend.cpu_kernel = "off"
        want, _ = _decode_ragged(*args, dtype=torch.float64)
        backend.cpu_kernel = "on"
        with monkeypatch.context() as m:
            _no_torch_decoding(m)
            got, _ = _decode_ragged(*args, dtype=torch.float64)
    for row, ref in zip(got, want):
        pos = sorted(row)
        torch.testing.assert_close(torch.stack([row[p] for p in pos]), torch.stack([ref[p] for p in pos]),
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["overlapping blocks", "per-head selection", "bfloat16", "cpu_kernel=off"])
def test_fused_decoding_kernel_is_used_only_where_it_applies(case):
    """Where the kernel does not apply (overlapping compressed blocks, a selection per query head, a type it does
    not take) or is turned off, the torch decoding runs; the seed's settings take the kernel."""
    geometry = dict(block=8, stride=4, sel=8) if case == "overlapping blocks" else dict(block=8, stride=8, sel=8)
    backend = make(**geometry, share_selection=case != "per-head selection")
    backend.cpu_kernel = "off" if case == "cpu_kernel=off" else "auto"
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    backend.to(dtype)
    q, k, v, x = (t.to(dtype) for t in inputs(12))
    cache = backend.new_cache(2, 12, torch.device("cpu"), dtype)
    with torch.no_grad():
        backend(q[:, :10], k[:, :10], v[:, :10], cache=cache, x=x[:, :10])
        g = torch.sigmoid(backend.gate(x[:, 10:11])).view(2, 1, 4, 3)
        assert backend._fused_decoder(q[:, 10:11], g, cache) is None
        seed = make(block=8, stride=8, sel=8, importance="logits_softmax", min_importance=1e-10, compress_mem_kv=1)
        cache = seed.new_cache(2, 12, torch.device("cpu"), torch.float32)
        q, k, v, x = inputs(12)
        seed(q[:, :10], k[:, :10], v[:, :10], cache=cache, x=x[:, :10])
        g = torch.sigmoid(seed.gate(x[:, 10:11])).view(2, 1, 4, 3)
        assert seed._fused_decoder(q[:, 10:11], g, cache) is not None
