"""Counter-based row noise (efftx.kernels.row_noise): the C++ CPU kernel against the torch reference over many
shapes, the reference's statistics, and the per-row streams sampling draws from (efftx.generation.sampling.Stream).
The Triton kernel's own tests are in tests/test_row_noise_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from efftx.generation.sampling import Stream, draw, race_noise, stream_noise
from efftx.generation.speculative import step_noise
from efftx.kernels import row_noise as rn
from efftx.kernels import row_noise_cpu


def _keys(rows: int, seed: int = 0) -> torch.Tensor:
    keys = torch.randint(0, 2**32, (rows, 2), generator=torch.Generator().manual_seed(seed))
    if rows >= 2:  # the extremes of both halves
        keys[0] = torch.tensor([0, 0])
        keys[1] = torch.tensor([2**32 - 1, 2**32 - 1])
    return keys


def test_the_kernel_builds_here():
    assert row_noise_cpu.kernel() is not None


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 16, 33])
@pytest.mark.parametrize("width", [0, 1, 7, 256, 257, 1542, 3001])
def test_the_kernel_matches_the_reference(rows, width):
    keys = _keys(rows, rows * 1000 + width)
    got = row_noise_cpu.kernel().row_noise(keys, width)
    ref = rn.row_noise_reference(keys, width)
    assert got.shape == ref.shape == (rows, width) and got.dtype == torch.float32
    # the same bits, then a float32 log each: at most a unit in the last place apart
    torch.testing.assert_close(got, ref, rtol=2.5e-7, atol=0)


def test_the_comparison_tells_a_wrong_hash_apart(monkeypatch):
    """The check above has power: the reference with another multiplier is far from the kernel."""
    keys = _keys(4)
    good = row_noise_cpu.kernel().row_noise(keys, 256)
    monkeypatch.setattr(rn, "C2", rn.C2 + 2)
    wrong = rn.row_noise_reference(keys, 256)
    assert not torch.allclose(good, wrong, rtol=2.5e-7, atol=0)
    assert (good - wrong).abs().max() > 1


def mix32_int(x: int) -> int:
    """The 32-bit finalizer on one Python int, written out: the scalar form the kernels compute."""
    x ^= x >> 16
    x = (x * rn.C1) & rn.M32
    x ^= x >> 15
    x = (x * rn.C2) & rn.M32
    return x ^ (x >> 15)


def test_the_reference_mixes_as_the_scalar_function():
    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    got = rn.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [mix32_int(v) for v in values]
    assert all(0 <= v < 2**32 for v in got)
    assert rn.C1 < 2**31 and rn.C2 < 2**31  # x * C stays below 2**63 in int64 for every 32-bit x
    # a bijection on a sample: no two inputs of a range share an output
    x = torch.arange(1 << 16, dtype=torch.int64) * 65537
    assert rn.mix32(x).unique().numel() == x.numel()


def test_row_noise_dispatches_to_the_kernel_and_can_be_switched_off():
    keys = _keys(3)
    assert row_noise_cpu.takes(keys)
    torch.testing.assert_close(rn.row_noise(keys, 100), row_noise_cpu.kernel().row_noise(keys, 100), rtol=0, atol=0)
    with row_noise_cpu.disabled():
        assert not row_noise_cpu.takes(keys)
        assert torch.equal(rn.row_noise(keys, 100), rn.row_noise_reference(keys, 100))


@pytest.mark.parametrize("keys, width, match", [
    (torch.zeros(3, 2, dtype=torch.int32), 4, "int64"),
    (torch.zeros(3, 3, dtype=torch.int64), 4, r"\(rows, 2\)"),
    (torch.zeros(3, dtype=torch.int64), 4, r"\(rows, 2\)"),
    (torch.zeros(3, 2, dtype=torch.int64), -1, "width"),
    (torch.zeros(3, 2, dtype=torch.int64), 2.5, "width"),
])
def test_bad_arguments_raise_naming_them(keys, width, match):
    with pytest.raises(ValueError, match=match):
        rn.row_noise(keys, width)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_a_rows_values_depend_on_its_key_and_index_only(impl):
    fn = row_noise_cpu.kernel().row_noise if impl == "kernel" else rn.row_noise_reference
    keys = _keys(9, 3)
    full = fn(keys, 1000)
    assert torch.equal(fn(keys, 300), full[:, :300])  # a prefix: the same whatever the width asked for
    for b in range(9):
        assert torch.equal(fn(keys[b:b + 1], 1000)[0], full[b])  # alone as in the batch
    assert not torch.equal(full[2], full[3])


def test_the_noise_is_exp1_and_its_elements_uncorrelated():
    """Fixed keys: deterministic statistics of 64 x 4096 values."""
    keys = _keys(64, 7)
    e = rn.row_noise_reference(keys, 4096)
    assert e.min() > 0 and math.isfinite(e.max().item())
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.03  # Exp(1): mean 1, variance 1
    u = torch.exp(-e).flatten()  # uniform on (0, 1)
    counts = torch.histc(u, 64, 0, 1)
    expected = u.numel() / 64
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 120  # 63 degrees of freedom: the 99.99th percentile is about 116
    for a, b in ((e[:, :-1], e[:, 1:]), (e[:-1], e[1:])):  # neighbouring elements, neighbouring rows
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.01


def test_a_streams_draws_follow_one_another_and_rewind():
    s = Stream(42)
    first, second = s.key(), s.key()
    assert first != second and s.get_state() == 2
    s.set_state(1)
    assert s.key() == second
    again = Stream(42)
    assert again.key() == first
    assert Stream(43).key() != first
    assert all(0 <= half < 2**32 for half in first)
    assert Stream(-1).key() == Stream(2**64 - 1).key()  # seeds are taken mod 2**64, as torch's manual_seed does
    # the key written out is splitmix64(splitmix64(seed) ^ draws), halves low first
    for seed, draws in ((0, 0), (42, 1), (2**63 - 1, 12345), (-5, 7)):
        s = Stream(seed)
        s.set_state(draws)
        z = rn.splitmix64(rn.splitmix64(seed & rn.M64) ^ draws)
        assert s.key() == (z & rn.M32, z >> 32) and s.get_state() == draws + 1


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 1.5, True, "3"])
def test_bad_seeds_raise(seed):
    with pytest.raises(ValueError, match="seed"):
        Stream(seed)


def test_a_fresh_stream_repeats_under_the_global_seed():
    torch.manual_seed(11)
    a = Stream.fresh()
    torch.manual_seed(11)
    b = Stream.fresh()
    assert a.seed == b.seed and a.key() == b.key()


def test_race_noise_draws_every_stream_row_in_one_call_alone_or_batched(monkeypatch):
    calls = []
    real = rn.row_noise

    def counted(keys, width):
        calls.append(keys.shape[0])
        return real(keys, width)

    monkeypatch.setattr("efftx.generation.sampling.row_noise", counted)
    batch = [Stream(s) for s in (5, 6, 7, 8)]
    noise = race_noise(batch, 50, need=[True, False, True, True])
    assert calls == [4]
    assert torch.equal(noise[1], torch.ones(50)) and batch[1].get_state() == 0  # not needed: no draw
    for b, seed in ((0, 5), (2, 7), (3, 8)):
        assert torch.equal(noise[b], race_noise([Stream(seed)], 50)[0])  # what the row draws alone
    assert [s.get_state() for s in batch] == [1, 0, 1, 1]
    # rows of torch generators beside streams still draw exactly what torch.multinomial's draw is
    g, ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    mixed = race_noise([Stream(5), g], 50)
    assert torch.equal(mixed[0], race_noise([Stream(5)], 50)[0])
    assert torch.equal(mixed[1], torch.empty(50).exponential_(generator=ref))


def test_draws_from_streams_follow_the_distribution():
    """Many rows, each its own stream, one draw each: the tokens' frequencies are the distribution's."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    rows = 20000
    tokens = draw(probs.expand(rows, -1), [Stream(1000 + r) for r in range(rows)])
    freq = torch.bincount(tokens, minlength=6).float()
    assert freq[5] == 0  # a token of probability 0 is never drawn
    expected = probs[:5] * rows
    chi2 = ((freq[:5] - expected) ** 2 / expected).sum().item()
    assert chi2 < 25  # 4 degrees of freedom: the 99.99th percentile is about 23.5
    # one stream's successive draws too
    s = Stream(9)
    seq = torch.stack([draw(probs[None], [s])[0] for _ in range(4000)])
    freq = torch.bincount(seq, minlength=6).float()
    chi2 = ((freq[:5] - probs[:5] * 4000) ** 2 / (probs[:5] * 4000)).sum().item()
    assert chi2 < 25 and freq[5] == 0


def test_step_noise_of_streams_is_what_each_row_draws_alone():
    vocab, own = 11, [3, 0, 1]
    noises, u, last = step_noise([Stream(1), Stream(2), Stream(3)], own, 3, vocab, "cpu")
    assert noises.shape == (3, 3, vocab) and u.shape == (3, 3) and last.shape == (3, vocab)
    for b, (seed, n) in enumerate(zip((1, 2, 3), own)):
        if not n:
            continue
        # alone, with only its own drafts' width: the same values where it reads them
        a_noises, a_u, a_last = step_noise([Stream(seed)], [n], n, vocab, "cpu")
        assert torch.equal(noises[:n, b], a_noises[:, 0])
        assert torch.equal(u[b, :n], a_u[0])
        assert torch.equal(last[b], a_last[0])
    streams = [Stream(1), Stream(2)]
    step_noise(streams, [2, 0], 2, vocab, "cpu")
    assert [s.get_state() for s in streams] == [1, 0]  # a finished row draws nothing


def test_stream_noise_on_the_reference_path_is_the_kernels_within_an_ulp():
    streams = [Stream(s) for s in range(6)]
    with row_noise_cpu.disabled():
        ref = stream_noise(streams, 300)
    for s in streams:
        s.set_state(0)
    torch.testing.assert_close(stream_noise(streams, 300), ref, rtol=2.5e-7, atol=0)


def test_a_gpu_kernel_that_fails_leaves_the_draws_to_the_reference(monkeypatch, caplog):
    """Where the Triton kernel cannot build or launch (a GPU machine without its compiler), draws take the torch
    reference from then on, said once in the log, and no request fails for it."""
    from efftx.kernels import row_noise_gpu

    tried = []

    def broken(keys, width):
        tried.append(width)
        raise RuntimeError("ptxas not found")

    monkeypatch.setattr(row_noise_gpu, "_state", {"enabled": True})
    monkeypatch.setattr(row_noise_gpu, "takes", lambda keys: row_noise_gpu._state["enabled"])
    monkeypatch.setattr(row_noise_gpu, "row_noise", broken)
    keys = _keys(3)
    with caplog.at_level("WARNING", logger="efftx.kernels.row_noise"):
        first = rn._on_gpu(keys, 40)
        second = rn._on_gpu(keys, 40)
    assert torch.equal(first, rn.row_noise_reference(keys, 40)) and torch.equal(second, first)
    assert tried == [40] and not row_noise_gpu._state["enabled"]  # not tried again
    assert [r.getMessage() for r in caplog.records] == [
        "efftx's Triton row noise kernel failed (RuntimeError: ptxas not found): draws take the torch reference"]
