"""efftx's C++ CPU sampling kernel (efftx.kernels.sampling_cpu): distributions against the torch path and float64
over many shapes and settings, the documented tie and edge-case rules, rows the same alone and batched, one setting
and settings per row alike, the race and a speculative step's acceptance equal to torch's, which calls take it,
the operators in compiled graphs, and bad input named."""

from __future__ import annotations

import pytest
import torch

from efftx.generation import sampling
from efftx.generation.sampling import probabilities, probabilities_per_row, race
from efftx.generation.speculative import accept_sampled
from efftx.kernels import sampling_cpu

MODULE = sampling_cpu.kernel()
SETTINGS = [(1.0, 0, 1.0), (0.8, 32, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.5), (2.0, 3, 0.01), (0.5, 1, 1.0),
            (1.0, 0, 0.999), (0.9, 100000, 0.3), (1e-3, 0, 1.0)]
VOCABS = [1, 2, 7, 15, 16, 17, 31, 33, 256, 257, 1000]


def torch_probabilities(logits, t, k, p):
    with sampling_cpu.disabled():
        return probabilities(logits, t, k, p)


def reference64(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """The documented semantics in float64, one row at a time (ties of a nucleus: lower index first)."""
    out = []
    for row in logits.reshape(-1, logits.shape[-1]).double():
        if t < sampling.MIN_TEMPERATURE:
            out.append(torch.nn.functional.one_hot(row.argmax(), row.numel()).double())
            continue
        y = (row.float() / torch.tensor(t, dtype=torch.float32)).double()  # x / t rounds to float32 in both paths
        if 0 < k < y.numel():
            y = y.masked_fill(y < torch.sort(y, descending=True).values[k - 1], float("-inf"))
        if p < 1.0:
            e = y.softmax(-1)
            order = sorted(range(y.numel()), key=lambda i: (-float(y[i]), i))
            before = 0.0
            for j, i in enumerate(order):
                if j and before >= p:
                    y[i] = float("-inf")
                before += float(e[i])
        out.append(y.softmax(-1))
    return torch.stack(out).view(logits.shape)


def test_the_kernel_builds_here():
    """The suite runs where `make setup` built it: a build failure here must fail, not fall back quietly."""
    assert MODULE is not None, sampling_cpu.KERNEL.load()[1]


@pytest.mark.parametrize("v", VOCABS)
def test_distributions_against_float64_and_the_torch_path(v):
    g = torch.Generator().manual_seed(v)
    for rows in (1, 3, 8, 48):
        x = 3 * torch.randn(rows, v, generator=g)
        for t, k, p in SETTINGS:
            got = probabilities(x, t, k, p)
            assert got.dtype == torch.float32 and got.shape == x.shape
            ref = reference64(x, t, k, p)
            # the same tokens kept (up to float32's underflow: a token below e^-87 of the top gets 0 here)
            assert not (got > 0)[ref == 0].any() and (got > 0)[ref > 1e-30].all(), (rows, t, k, p)
            torch.testing.assert_close(got.double(), ref, rtol=3e-6, atol=1e-9)
            torch.testing.assert_close(got, torch_probabilities(x, t, k, p), rtol=3e-6, atol=1e-8)


def test_leading_dimensions_and_non_contiguous_logits():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 40, generator=g)
    torch.testing.assert_close(probabilities(x, 0.8, 5, 0.9), torch_probabilities(x, 0.8, 5, 0.9))
    xt = torch.randn(40, 3, generator=g).t()
    assert not xt.is_contiguous()
    assert torch.equal(probabilities(xt, 0.8, 5, 0.9), probabilities(xt.contiguous(), 0.8, 5, 0.9))


def test_rows_are_bit_for_bit_the_same_alone_batched_and_with_settings_per_row():
    g = torch.Generator().manual_seed(2)
    x = 2 * torch.randn(11, 300, generator=g)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(11)]
    t = torch.tensor([s[0] for s in settings])
    k = torch.tensor([s[1] for s in settings])
    p = torch.tensor([s[2] for s in settings])
    rows = probabilities_per_row(x, t, k, p)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rows2 = probabilities_per_row(x, t, k, p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(rows, rows2)
    for b, (tb, kb, pb) in enumerate(settings):
        # the per-row settings are float32: row b gets exactly what one float32 setting gets
        alone = probabilities(x[b:b + 1], float(t[b]), kb, float(p[b]))
        assert torch.equal(rows[b:b + 1], alone), b
        batched = probabilities(x, float(t[b]), kb, float(p[b]))
        assert torch.equal(batched[b], alone[0]), b
    # (B, G, V): row b's settings for all its positions; the hints (no top-k, no nucleus) are honoured
    x3 = torch.randn(4, 3, 50, generator=g)
    t3, k3, p3 = torch.tensor([0.5, 1.0, 0.0, 2.0]), torch.tensor([3, 0, 0, 7]), torch.tensor([0.9, 0.2, 1.0, 1.0])
    got = probabilities_per_row(x3, t3, k3, p3)
    for b in range(4):
        assert torch.equal(got[b], probabilities(x3[b], float(t3[b]), int(k3[b]), float(p3[b])))
    no_hints = probabilities_per_row(x3, t3, k3, p3, kmax=0, nucleus=False)
    for b in range(4):
        assert torch.equal(no_hints[b], probabilities(x3[b], float(t3[b]), 0, 1.0))
    with sampling_cpu.disabled():
        torch.testing.assert_close(probabilities_per_row(x3, t3, k3, p3), got, rtol=3e-6, atol=1e-8)


def test_greedy_ties_nan_and_infinite_rows():
    # greedy: one-hot at the first maximum (as torch.argmax), below MIN_TEMPERATURE in double as in Python
    x = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    for t in (0.0, 9.99e-5, 0.99999999 * sampling.MIN_TEMPERATURE):
        assert probabilities(x, t, 0, 1.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert probabilities(x * 1e-4, sampling.MIN_TEMPERATURE, 0, 1.0)[0, 0] > 0  # at the floor: sampled
    # top-k counts ties: the k-th largest value keeps every token equal to it
    assert (probabilities(torch.tensor([[1.0, 5.0, 5.0, 5.0, 2.0]]), 1.0, 2, 1.0) > 0).tolist() == [
        [False, True, True, True, False]]
    # a nucleus over equal values keeps the lowest indices first, and always the first
    flat = torch.zeros(1, 8)
    assert (probabilities(flat, 1.0, 0, 0.3) > 0).tolist() == [[True, True, True] + [False] * 5]
    assert (probabilities(flat, 1.0, 0, 1e-30) > 0).tolist() == [[True] + [False] * 7]
    assert (probabilities(flat, 1.0, 0, 0.0) > 0).tolist() == [[True] + [False] * 7]
    # a NaN anywhere, or no finite maximum: NaN everywhere, as torch's softmax gives
    for row in ([1.0, float("nan"), 0.0], [float("-inf")] * 3, [0.0, float("inf"), 1.0]):
        x = torch.tensor([row, [0.0, 1.0, 2.0]])
        got = probabilities(x, 1.0, 0, 1.0)
        assert got[0].isnan().all() and not got[1].isnan().any()
        assert torch_probabilities(x, 1.0, 0, 1.0)[0].isnan().all()
    # -inf logits are dropped tokens, the others still a distribution
    got = probabilities(torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]]), 1.0, 0, 1.0)
    assert got[0, 0] == 0 and got[0, 3] == 0
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))


def test_the_race_equals_torch_ties_and_nan_included():
    g = torch.Generator().manual_seed(3)
    for v in (1, 5, 16, 17, 256, 1000):
        probs = probabilities(torch.randn(9, v, generator=g), 1.0, 0, 1.0)
        noise = torch.empty(9, v).exponential_(generator=g)
        assert torch.equal(race(probs, noise), (probs / noise).argmax(-1))
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.5, 0.0, 0.5], [0.5, 0.0, 0.5, 0.0]])
    noise = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 1.0, 2.0], [1.0, 1.0, 0.0, 0.0]])  # 0/0: NaN wins
    assert race(probs, noise).tolist() == (probs / noise).argmax(-1).tolist() == [0, 1, 3]
    assert race(probs[None], noise[None]).shape == (1, 3)


def _accept_inputs(g, rows, gamma, v):
    p = probabilities(2 * torch.randn(rows, gamma + 1, v, generator=g), 0.9, 0, 1.0)
    q = probabilities(2 * torch.randn(rows, gamma, v, generator=g), 0.9, 0, 1.0)
    drafted = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(rows, gamma)
    own = torch.randint(0, gamma + 1, (rows,), generator=g)
    u = torch.rand(rows, gamma, generator=g)
    noise = torch.empty(rows, v).exponential_(generator=g)
    return p, q, drafted, u, noise, own


def test_acceptance_equals_the_torch_acceptance():
    g = torch.Generator().manual_seed(4)
    cases = 0
    for trial in range(240):
        rows, gamma, v = 1 + trial % 8, 1 + trial % 6, (2, 17, 256, 300)[trial % 4]
        p, q, drafted, u, noise, own = _accept_inputs(g, rows, gamma, v)
        if trial % 3 == 0:
            q = p[:, :gamma].clone()  # ratio 1: every draft accepted; a rejection's residual is all zero
        if trial % 5 == 0:
            u = torch.zeros_like(u)
        got = accept_sampled(p, q, drafted, u, noise, own)
        with sampling_cpu.disabled():
            want = accept_sampled(p, q, drafted, u, noise, own)
        assert torch.equal(got, want), trial
        cases += int((got[:, 0] < own).any())
    assert cases > 50  # rejections (the residual) are exercised, not only full acceptance


def test_which_calls_take_the_kernel():
    x = torch.randn(2, 10)
    assert sampling_cpu.takes(x)
    assert not sampling_cpu.takes(x.double())
    leaf = x.clone().requires_grad_()
    assert not sampling_cpu.takes(leaf)
    with torch.no_grad():
        assert sampling_cpu.takes(leaf)
    assert sampling_cpu.probabilities(x.double(), 1.0, 0, 1.0) is None
    assert sampling_cpu.race(x, torch.ones(2, 11)) is None  # shapes differ: torch's broadcasting rules
    # autograd: the torch path, whose gradient flows
    probabilities(leaf, 1.0, 0, 1.0)[0, 0].backward()
    assert leaf.grad is not None
    with sampling_cpu.disabled():
        assert not sampling_cpu.takes(x)
        assert sampling_cpu.probabilities(x, 1.0, 0, 1.0) is None


def test_bad_input_is_named():
    x = torch.randn(2, 5)
    with pytest.raises(RuntimeError, match="float32 logits"):
        MODULE.probabilities(x.double(), 1.0, 0, 1.0)
    with pytest.raises(RuntimeError, match="one setting per row: 2 rows"):
        MODULE.probabilities_rows(x, torch.ones(3), torch.zeros(2, dtype=torch.long), torch.ones(2), True, True)
    with pytest.raises(RuntimeError, match="differ in shape"):
        MODULE.race(x, torch.ones(2, 6))
    p, q, drafted, u, noise, own = _accept_inputs(torch.Generator().manual_seed(5), 2, 3, 9)
    with pytest.raises(RuntimeError, match="shapes differ"):
        MODULE.accept(p, q[:, :2], drafted, u, noise, own)
    with pytest.raises(RuntimeError, match="out of the vocabulary"):
        MODULE.accept(p, q, drafted + 9, u, noise, torch.full((2,), 3))


def test_compiled_graphs_call_the_operators_and_match_eager():
    p, q, drafted, u, noise, own = _accept_inputs(torch.Generator().manual_seed(6), 3, 4, 40)
    logits = torch.randn(3, 40)

    def step(logits, p, q, drafted, u, noise, own):
        probs = probabilities(logits, 0.8, 5, 0.9)
        return probs, race(probs, noise), accept_sampled(p, q, drafted, u, noise, own)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(logits, p, q, drafted, u, noise, own)
    want = step(logits, p, q, drafted, u, noise, own)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    seen = []  # the graphs dynamo hands its backend: the kernel's operators, not torch's decomposition

    def backend(gm, example_inputs):
        seen.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(logits, p, q, drafted, u, noise, own)
    graph = "".join(seen)
    for op in ("cpu_probabilities", "cpu_race", "cpu_accept"):
        assert op in graph, op
