"""efftx's C++ CPU linear kernel (efftx.kernels.linear_cpu): against its reference F.linear over many shapes (and its
GELU epilogue against float64's exact GELU), a row's result the same alone or in a batch, which calls take it, and
decoding with it equal to decoding without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from efftx import recipes
from efftx.generation.decode import generate
from efftx.kernels import linear_cpu
from efftx.models import build
from efftx.models.layers import MLP

MODULE = linear_cpu.kernel()


def test_the_kernel_builds_here():
    """The suite runs where `make setup` built it: a build failure here must fail, not fall back quietly."""
    assert MODULE is not None, linear_cpu.KERNEL.load()[1]


# K: below, at and around one 16-float vector, odd tails, model widths; N: around the 4-row blocks, odd, wide
SHAPES = [(k, n) for k in (1, 7, 16, 17, 40, 100, 512) for n in (1, 3, 4, 5, 11, 64, 257)]


@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_equals_f_linear_every_row_count_with_and_without_bias(k, n):
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 19):
        x = torch.randn(rows, k, generator=g)
        for bias in (None, b):
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
            got = MODULE.linear(x, w, bias)
            assert got.shape == (rows, n)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def _gelu64(y: torch.Tensor) -> torch.Tensor:
    return F.gelu(y.double()).float()


@pytest.mark.parametrize("k,n", SHAPES)
def test_the_gelu_epilogue_is_the_exact_gelu_of_the_kernels_product_every_row_count(k, n):
    """``gelu=True``: every output (the 16-float vectors, the tails, each thread's block of outputs) is the exact
    GELU of the plain kernel's product, within 1e-6 of float64's (torch's own float32 GELU is off by up to ~1.2e-6;
    the tanh approximation by up to ~5e-4)."""
    g = torch.Generator().manual_seed(k * 1000 + n + 1)
    w = torch.randn(n, k, generator=g) * (3 / k ** 0.5)  # outputs over about -10 .. 10
    b = torch.randn(n, generator=g)
    for rows in (1, 2, 3, 5, 8, 16):
        x = torch.randn(rows, k, generator=g)
        for bias in (None, b):
            got = MODULE.linear(x, w, bias, True)
            torch.testing.assert_close(got, _gelu64(MODULE.linear(x, w, bias)), rtol=1e-6, atol=8e-7)


def test_the_gelu_epilogue_over_a_dense_grid_of_inputs_and_far_out():
    """Through a 1 x 1 identity weight (the product exact), 200,001 inputs over -12 .. 12 and some far out (no NaN,
    no overflow: GELU(x) is x far right, 0 far left)."""
    z = torch.cat([torch.linspace(-12, 12, 200001), torch.tensor([-1e4, -100.0, -30.0, 30.0, 100.0, 1e4, 0.0])])
    eye = torch.ones(1, 1)
    got = torch.cat([MODULE.linear(z[i:i + 16, None], eye, None, True) for i in range(0, len(z), 16)])[:, 0]
    torch.testing.assert_close(got, _gelu64(z), rtol=1e-6, atol=8e-7)
    assert torch.equal(got[-4:-1], torch.tensor([30.0, 100.0, 1e4])) and got[-7:-4].abs().max() < 1e-30
    # far left the GELU is below float32's normal range: 0 there, never a subnormal (which costs an Intel core a
    # hundred cycles and more per operation, here and in the next product)
    far = torch.cat([torch.linspace(-60, -12, 4801), -torch.logspace(2, 6, 50)])
    out = MODULE.linear(far[:, None], eye, None, True)[:, 0]
    subnormal = (out != 0) & (out.abs() < torch.finfo(torch.float32).tiny)
    assert not subnormal.any(), far[subnormal][:5]
    torch.testing.assert_close(out, _gelu64(far), rtol=1e-6, atol=8e-7)


def test_kernel_takes_any_leading_shape_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    x = torch.randn(2, 3, 40, generator=g)
    torch.testing.assert_close(MODULE.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xt = torch.randn(40, 3, generator=g).t()  # (3, 40), not contiguous
    torch.testing.assert_close(MODULE.linear(xt, w, None), F.linear(xt, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        MODULE.linear(x, torch.randn(40, 24).t(), None)
    with pytest.raises(RuntimeError, match="last dimension 39 != K = 40"):
        MODULE.linear(torch.randn(2, 39), w, None)
    with pytest.raises(RuntimeError, match="float32"):
        MODULE.linear(x.double(), w.double(), None)


def test_a_rows_result_is_bit_for_bit_the_same_alone_and_in_any_batch():
    """What makes batched decoding give each row what it gets alone, exactly (F.linear gives no such promise)."""
    g = torch.Generator().manual_seed(2)
    threads = torch.get_num_threads()
    for k, n in ((512, 1024), (100, 37), (2048, 512)):
        w = torch.randn(n, k, generator=g)
        x = torch.randn(16, k, generator=g)
        for gelu in (False, True):
            alone = torch.cat([MODULE.linear(x[i:i + 1], w, None, gelu) for i in range(16)])
            for rows in range(2, 17):
                batch = MODULE.linear(x[:rows], w, None, gelu)
                assert torch.equal(batch, alone[:rows]), (k, n, rows, gelu)
            perm = torch.randperm(16, generator=g)
            assert torch.equal(MODULE.linear(x[perm], w, None, gelu), alone[perm])
            try:  # the threads' blocks of outputs (and the GELU's vectors over them) split elsewhere: the same values
                torch.set_num_threads(1 if threads > 1 else 2)
                assert torch.equal(MODULE.linear(x, w, None, gelu), alone)
            finally:
                torch.set_num_threads(threads)


def test_the_prefetch_changes_no_result_and_its_switch_is_restored():
    """A block's first tile asks for the next block's weights (linear_cpu.cpp): the same bits with it off, at every
    row count (a first tile of 6, 4, 2 or 1 rows), N around the blocks (the last full block asks for none past the
    weights), float32 and bfloat16 weights, both thread counts; without_prefetch puts the setting back."""
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    for k, n in ((192, 768), (17, 9), (100, 12), (768, 192)):
        w32 = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g)
        for w in (w32, w32.to(torch.bfloat16)):
            for rows in (1, 2, 3, 4, 5, 6, 7, 12, 16):
                x = torch.randn(rows, k, generator=g)
                for nthreads in {1, threads}:
                    torch.set_num_threads(nthreads)
                    try:
                        on = MODULE.linear(x, w, b, True)
                        with linear_cpu.without_prefetch():
                            off = MODULE.linear(x, w, b, True)
                    finally:
                        torch.set_num_threads(threads)
                    assert torch.equal(on, off), (k, n, w.dtype, rows, nthreads)
    with linear_cpu.without_prefetch():
        assert MODULE.set_prefetch(False) is False  # off inside (and still off after this call)
    assert MODULE.set_prefetch(True) is True  # back on after


def test_which_calls_take_the_kernel():
    w = torch.randn(16, 32, requires_grad=True)
    x = torch.randn(1, 8, 32)
    with torch.no_grad():
        assert linear_cpu.takes(x, w)
        assert linear_cpu.takes(torch.randn(linear_cpu.MAX_ROWS, 32), w)
        assert not linear_cpu.takes(torch.randn(linear_cpu.MAX_ROWS + 1, 32), w)  # many rows: the BLAS is faster
        assert not linear_cpu.takes(x.bfloat16(), w.bfloat16())
        assert not linear_cpu.takes(torch.randn(1, 16), torch.randn(16, 32).t())  # a weight not (N, K) contiguous
        with linear_cpu.disabled():
            assert not linear_cpu.takes(x, w)
        assert linear_cpu.takes(x, w)
    assert not linear_cpu.takes(x, w)  # autograd records the product: F.linear
    assert linear_cpu.takes(x, w.detach())  # nothing to record


def test_linear_calls_the_kernel_only_where_it_takes_the_call(monkeypatch):
    calls = []
    real = MODULE.linear

    class Spy:
        @staticmethod
        def linear(*args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(linear_cpu, "kernel", lambda: Spy)
    layer = linear_cpu.Linear(32, 16)
    with torch.no_grad():
        layer(torch.randn(3, 32))
        layer(torch.randn(20, 32))
    out = layer(torch.randn(2, 32))
    out.sum().backward()  # training: F.linear, with gradients
    assert layer.weight.grad is not None and layer.bias.grad is not None
    assert calls == [(3, 32)]


def test_an_unbuildable_kernel_falls_back_to_f_linear_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(linear_cpu.KERNEL, "load", lambda: (None, "RuntimeError: no C++ compiler"))
    linear_cpu.KERNEL.warned.clear()
    w, x = torch.randn(8, 16), torch.randn(1, 16)
    with caplog.at_level("WARNING", logger=linear_cpu.__name__), torch.no_grad():
        got = linear_cpu.linear(x, w)
    assert "CPU linear kernel is unavailable (RuntimeError: no C++ compiler)" in caplog.text
    assert torch.equal(got, F.linear(x, w))
    with torch.no_grad():
        assert torch.equal(linear_cpu.linear(x, w, None, gelu=True), F.gelu(F.linear(x, w)))
    with pytest.raises(RuntimeError, match="could not be built: RuntimeError: no C"):
        linear_cpu.build(log_line=lambda line: None)
    linear_cpu.KERNEL.warned.clear()


def test_the_linear_module_keeps_nn_linears_parameters_and_state_dict():
    torch.manual_seed(0)
    plain = nn.Linear(12, 5)
    ours = linear_cpu.Linear(12, 5)
    ours.load_state_dict(plain.state_dict())
    assert list(ours.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["lm_debug", "nsa_debug"])
def test_cached_decoding_with_the_kernel_equals_decoding_without_it(recipe, monkeypatch):
    """Every Linear weight of the model goes through the kernel in the decoding steps (a spy records them; the
    prompts' prefill has too many rows), the feed-forwards' up projections with their GELU in it, and greedy decoding
    gives the same tokens as without it."""
    cfg = recipes.get(recipe)
    torch.manual_seed(0)
    model = build(cfg).eval()
    prompts = torch.randint(0, cfg.model.vocab_size, (3, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), linear_cpu.disabled():
        want_logits = model(prompts[:1, :1])
        want = generate(model, prompts, 16, temperature=0.0)
    seen, gelus = [], set()
    real = MODULE.linear

    class Spy:
        @staticmethod
        def linear(x, w, b, gelu=False):
            seen.append((x.shape[:-1].numel(), w.data_ptr()))
            if gelu:
                gelus.add(w.data_ptr())
            return real(x, w, b, gelu)

    monkeypatch.setattr(linear_cpu, "kernel", lambda: Spy)
    with torch.no_grad():
        got_logits = model(prompts[:1, :1])
        got = generate(model, prompts, 16, temperature=0.0)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, want)
    weights = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Linear)}
    if model.head is None:  # tied: the logits are the embedding table's product
        weights.add(model.embed.weight.data_ptr())
    assert {ptr for _, ptr in seen} == weights
    assert {rows for rows, _ in seen} == {1, 3}  # the single-token call, then the 3 rows' decoding steps
    assert gelus == {m.up.weight.data_ptr() for m in model.modules() if isinstance(m, MLP)} and gelus
    assert all(isinstance(m, linear_cpu.Linear) for m in model.modules() if isinstance(m, nn.Linear))


def test_compiled_graphs_call_the_kernel_as_an_operator_with_the_same_result():
    """torch.compile traces the call as efftx::cpu_linear (a graph capture lists it); with grad on, or too many rows,
    the graph holds F.linear's product instead."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(any(str(node.target).startswith("efftx.cpu_linear") for node in gm.graph.nodes))
        return gm.forward

    layer = linear_cpu.Linear(40, 24)
    fn = torch.compile(lambda x: layer(x), backend=capture, fullgraph=True, dynamic=False)
    x = torch.randn(3, 40)
    with torch.no_grad():
        got = fn(x)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert graphs[-1]
        fn(torch.randn(linear_cpu.MAX_ROWS + 1, 40))
        assert not graphs[-1]
    fn(x).sum().backward()
    assert not graphs[-1] and layer.weight.grad is not None
    with torch.no_grad(), linear_cpu.disabled():  # switched off: a guard fails and the graph is traced again
        fn(x)
        assert not graphs[-1]
    up = torch.compile(lambda x: layer(x, gelu=True), backend=capture, fullgraph=True, dynamic=False)
    with torch.no_grad():  # the GELU too: in the operator, the same values as eagerly
        got = up(x)
        assert graphs[-1]
        assert torch.equal(got, layer(x, gelu=True))
        torch.testing.assert_close(got, F.gelu(F.linear(x, layer.weight, layer.bias)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module", ["linear_cpu", "nsa_selected_cpu", "decode_attention_cpu", "rms_norm_cpu"])
def test_the_kernels_release_the_gil_while_they_run(module):
    """Another Python thread runs while a kernel call is under way (a Serve replica's HTTP threads beside its
    decoding thread). The main thread, woken as the call starts, takes the time; a binding that holds the GIL
    keeps it waiting until the call is over (then its time comes after the call's end), one that releases it lets
    it run at once (early in the call; half the call's length is the line, the kernel runs on one thread)."""
    import threading
    import time

    if module == "linear_cpu":
        g = torch.Generator().manual_seed(4)
        x, w = torch.randn(4096, 1024, generator=g), torch.randn(2048, 1024, generator=g)  # ~0.5 s of products
        call = lambda: MODULE.linear(x, w, None)  # noqa: E731
    elif module == "rms_norm_cpu":
        from efftx.kernels import rms_norm_cpu

        kernel = rms_norm_cpu.kernel()
        x, w = torch.randn(8192, 8192, generator=torch.Generator().manual_seed(7)), torch.ones(8192)  # ~0.1 s
        call = lambda: kernel.rms_norm(x, w, 1e-6)  # noqa: E731
    elif module == "decode_attention_cpu":
        from efftx.kernels import decode_attention_cpu

        kernel = decode_attention_cpu.kernel()
        g = torch.Generator().manual_seed(6)
        k, v = torch.randn(32, 4096, 4, 64, generator=g), torch.randn(32, 4096, 4, 64, generator=g)
        q, kn, vn = torch.randn(32, 16, 8, 64, generator=g), torch.randn(32, 16, 4, 64, generator=g), torch.randn(
            32, 16, 4, 64, generator=g)  # ~0.3 s of attention over 4000 cached keys
        call = lambda: kernel.attend(q, kn, vn, k, v, [4000] * 32, True, 0.125)  # noqa: E731
    else:
        from efftx.kernels import nsa_selected_cpu

        kernel = nsa_selected_cpu.kernel(required=True)
        s = torch.randn(1, 4, 16384, 1024, generator=torch.Generator().manual_seed(5))  # raw compressed scores
        sel = torch.empty(16384, 1, 4, 4, dtype=torch.int64)  # ~0.2 s of softmax and selection
        call = lambda: kernel.compressed_select(s, sel, 1, 0, 16, 16, 0, 16, 4, 1023, 0, 1, 1e-10, False)  # noqa: E731
    times, started = {}, threading.Event()

    def worker():
        times["start"] = time.perf_counter()
        started.set()
        call()
        times["end"] = time.perf_counter()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the other core stays free for the main thread
    try:
        t = threading.Thread(target=worker)
        t.start()
        started.wait()
        times["main"] = time.perf_counter()
        t.join()
    finally:
        torch.set_num_threads(threads)
    call_s = times["end"] - times["start"]
    assert times["main"] - times["start"] < 0.5 * call_s, times
