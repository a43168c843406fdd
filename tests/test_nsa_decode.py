"""NSA cached decoding over ragged rows (issue 15): each row of a batched cache at its own position gives the
uncached forward of that row alone, through prefills of different lengths, steps, per-row rewinds, query chunks of
the decoding path, and rows split and joined (continuous batching)."""

from __future__ import annotations

import pytest
import torch

from efftx import recipes
from efftx.attention import nsa
from efftx.attention.nsa import NSACache
from efftx.generation.decode import Rows, splittable
from efftx.models import build as build_model
from test_nsa import OPTION_CASES, inputs, make  # tests/test_nsa.py


def _decode_ragged(backend, q, k, v, x, prompts, steps, rewinds=()):
    """Feed row b its first prompts[b] tokens (one padded prefill, the padding rewound, as Rows.prefill does), then
    ``steps`` (tokens per call) at each row's own position; ``rewinds`` (after call i, counts per row). Returns each
    row's output per position (a dict position -> (H, D), the latest write of a position winning)."""
    b, t = q.shape[:2]
    cache = backend.new_cache(b, t, torch.device("cpu"), torch.float32)
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
    """splittable(nsa model) holds; rows taken out of a batched state (Rows.select) and joined with another batch
    (Rows.concat) give, step by step, the logits each row gets decoding alone."""
    model = _lm(**options)
    assert model.supports_ragged and splittable(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 2, 8)]
    feed = torch.randint(0, 256, (4, 12), generator=g)
    cap = 40
    alone = []
    for r, p in enumerate(prompts):  # each row decoding alone (batch 1)
        state = Rows(model, 1, cap, batched=True)
        logits = [state.prefill([p])]
        logits += [state.forward(feed[r:r + 1, i:i + 1])[:, -1] for i in range(12)]
        alone.append(torch.cat(logits))
    with torch.no_grad():
        first = Rows(model, 2, cap)
        assert first.batched
        got = {0: [first.prefill(prompts[:2])], 1: []}
        got[1] = [got[0][0][1:]]
        got[0] = [got[0][0][:1]]
        for i in range(3):  # rows 0, 1 together
            out = first.forward(feed[:2, i:i + 1])[:, -1]
            got[0].append(out[:1])
            got[1].append(out[1:])
        second = Rows(model, 2, cap)
        start = second.prefill(prompts[2:])
        got[2], got[3] = [start[:1]], [start[1:]]
        for i in range(2):  # rows 2, 3 advance two tokens alone
            out = second.forward(feed[2:, i:i + 1])[:, -1]
            got[2].append(out[:1])
            got[3].append(out[1:])
        # row 1 leaves; rows 3, 0, 2 decode together, each at its own position
        state = Rows.concat([second.select([1]), first.select([0]), second.select([0])])
        order = [3, 0, 2]
        done = {3: 2, 0: 3, 2: 2}
        for _ in range(4):
            tok = torch.stack([feed[r, done[r]] for r in order])[:, None]
            out = state.forward(tok)[:, -1]
            for j, r in enumerate(order):
                got[r].append(out[j:j + 1])
                done[r] += 1
        state.rewind([1, 0, 2])  # per-row rewinds of the joined state, then the same tokens again
        for r, n in zip(order, [1, 0, 2]):
            del got[r][len(got[r]) - n:]
            done[r] -= n
        for _ in range(3):
            tok = torch.stack([feed[r, done[r]] for r in order])[:, None]
            out = state.forward(tok)[:, -1]
            for j, r in enumerate(order):
                got[r].append(out[j:j + 1])
                done[r] += 1
    for r in range(4):
        row = torch.cat(got[r])
        torch.testing.assert_close(row, alone[r][:len(row)], rtol=1e-4, atol=1e-4, msg=lambda m: f"row {r}: {m}")


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
