"""efftx's C++ CPU RMSNorm kernel (efftx.kernels.rms_norm_cpu): against its reference F.rms_norm over many shapes, a
row's result the same alone or in a batch, which calls take it, and decoding (eager and compiled) with it equal to
decoding without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from efftx import recipes
from efftx.generation.decode import generate
from efftx.kernels import rms_norm_cpu
from efftx.models import build

MODULE = rms_norm_cpu.kernel()


def test_the_kernel_builds_here():
    """The suite runs where `make setup` built it: a build failure here must fail, not fall back quietly."""
    assert MODULE is not None, rms_norm_cpu.KERNEL.load()[1]


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64 (the kernel's values should lie within float32 rounding of it)."""
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


# D: below, at and around one 16-float vector, odd tails, model widths
@pytest.mark.parametrize("d", [1, 7, 15, 16, 17, 33, 64, 100, 192, 257, 1024])
def test_kernel_equals_the_reference_every_row_count(d):
    g = torch.Generator().manual_seed(d)
    w = torch.randn(d, generator=g)
    for rows in (1, 2, 3, 5, 16, 19, 64, 65, 300):
        for scale, eps in ((1.0, 1e-6), (1e-4, 1e-6), (30.0, 1e-5), (1.0, 0.5)):  # tiny rows: eps matters
            x = scale * torch.randn(rows, d, generator=g)
            got = MODULE.rms_norm(x, w, eps)
            assert got.shape == (rows, d)
            torch.testing.assert_close(got, reference(x, w, eps), rtol=2e-6, atol=1e-6)
            torch.testing.assert_close(got, F.rms_norm(x, (d,), w, eps), rtol=2e-6, atol=1e-6)


def test_kernel_takes_any_leading_shape_and_non_contiguous_inputs_and_names_bad_ones():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, generator=g)
    x = torch.randn(2, 3, 40, generator=g)
    torch.testing.assert_close(MODULE.rms_norm(x, w, 1e-6), F.rms_norm(x, (40,), w, 1e-6), rtol=2e-6, atol=1e-6)
    xt = torch.randn(40, 3, generator=g).t()  # (3, 40), not contiguous
    torch.testing.assert_close(MODULE.rms_norm(xt, w, 1e-6), F.rms_norm(xt, (40,), w, 1e-6), rtol=2e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        MODULE.rms_norm(x, torch.randn(80)[::2], 1e-6)
    with pytest.raises(RuntimeError, match="last dimension 39 != D = 40"):
        MODULE.rms_norm(torch.randn(2, 39), w, 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        MODULE.rms_norm(x.double(), w.double(), 1e-6)


def test_a_rows_result_is_bit_for_bit_the_same_alone_and_in_any_batch():
    """What makes batched decoding give each row what it gets alone, exactly, rows past the kernel's split over
    threads included."""
    g = torch.Generator().manual_seed(2)
    for d in (192, 100, 1024):
        w = torch.randn(d, generator=g)
        x = torch.randn(200, d, generator=g)
        alone = torch.cat([MODULE.rms_norm(x[i:i + 1], w, 1e-6) for i in range(200)])
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                for rows in (2, 7, 16, 65, 200):
                    assert torch.equal(MODULE.rms_norm(x[:rows], w, 1e-6), alone[:rows]), (d, rows, n)
        finally:
            torch.set_num_threads(threads)
        perm = torch.randperm(200, generator=g)
        assert torch.equal(MODULE.rms_norm(x[perm], w, 1e-6), alone[perm])


def test_which_calls_take_the_kernel():
    w = torch.randn(32, requires_grad=True)
    x = torch.randn(1, 8, 32)
    with torch.no_grad():
        assert rms_norm_cpu.takes(x, (32,), w, 1e-6)
        assert rms_norm_cpu.takes(torch.randn(4096, 32), (32,), w, 1e-6)  # any number of rows
        assert not rms_norm_cpu.takes(x.bfloat16(), (32,), w.bfloat16(), 1e-6)
        assert not rms_norm_cpu.takes(x, (32,), None, 1e-6)  # no weight
        assert not rms_norm_cpu.takes(x, (32,), w, None)  # torch's default eps (the dtype's): F.rms_norm
        assert not rms_norm_cpu.takes(x.view(1, 256), (8, 32), torch.randn(8, 32), 1e-6)  # over two dimensions
        with rms_norm_cpu.disabled():
            assert not rms_norm_cpu.takes(x, (32,), w, 1e-6)
        assert rms_norm_cpu.takes(x, (32,), w, 1e-6)
    assert not rms_norm_cpu.takes(x, (32,), w, 1e-6)  # autograd records the norm: F.rms_norm
    assert rms_norm_cpu.takes(x, (32,), w.detach(), 1e-6)  # nothing to record


def test_the_module_calls_the_kernel_only_where_it_takes_the_call_and_trains_on_torchs(monkeypatch):
    calls = []
    real = MODULE.rms_norm

    class Spy:
        @staticmethod
        def rms_norm(*args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(rms_norm_cpu, "kernel", lambda: Spy)
    norm = rms_norm_cpu.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm(torch.randn(3, 32))
    out = norm(torch.randn(2, 32))
    out.sum().backward()  # training: F.rms_norm, with gradients
    assert norm.weight.grad is not None
    assert calls == [(3, 32)]


def test_an_unbuildable_kernel_falls_back_to_f_rms_norm_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(rms_norm_cpu.KERNEL, "load", lambda: (None, "RuntimeError: no C++ compiler"))
    rms_norm_cpu.KERNEL.warned.clear()
    w, x = torch.randn(16), torch.randn(1, 16)
    with caplog.at_level("WARNING", logger=rms_norm_cpu.__name__), torch.no_grad():
        got = rms_norm_cpu.rms_norm(x, (16,), w, 1e-6)
    assert "CPU RMSNorm kernel is unavailable (RuntimeError: no C++ compiler)" in caplog.text
    assert torch.equal(got, F.rms_norm(x, (16,), w, 1e-6))
    with pytest.raises(RuntimeError, match="could not be built: RuntimeError: no C"):
        rms_norm_cpu.build(log_line=lambda line: None)
    rms_norm_cpu.KERNEL.warned.clear()


def test_the_module_keeps_nn_rmsnorms_parameter_and_state_dict():
    torch.manual_seed(0)
    plain = nn.RMSNorm(12, eps=1e-6)
    plain.weight.data.uniform_(0.5, 1.5)
    ours = rms_norm_cpu.RMSNorm(12, eps=1e-6)
    ours.load_state_dict(plain.state_dict())
    assert list(ours.state_dict()) == ["weight"] and isinstance(ours, nn.RMSNorm)
    x = torch.randn(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), plain(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", ["lm_debug", "nsa_debug"])
def test_cached_decoding_with_the_kernel_equals_decoding_without_it(recipe, monkeypatch):
    """Every norm of the model goes through the kernel when decoding (a spy records them: the prompts' prefill, then
    the steps), and greedy decoding gives the same tokens as without it."""
    cfg = recipes.get(recipe)
    torch.manual_seed(0)
    model = build(cfg).eval()
    prompts = torch.randint(0, cfg.model.vocab_size, (3, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), rms_norm_cpu.disabled():
        want_logits = model(prompts)
        want = generate(model, prompts, 16, temperature=0.0)
    seen = []
    real = MODULE.rms_norm

    class Spy:
        @staticmethod
        def rms_norm(x, w, eps):
            seen.append((x.shape[:-1].numel(), w.data_ptr()))
            return real(x, w, eps)

    monkeypatch.setattr(rms_norm_cpu, "kernel", lambda: Spy)
    with torch.no_grad():
        got_logits = model(prompts)
        got = generate(model, prompts, 16, temperature=0.0)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, want)
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert norms and all(isinstance(m, rms_norm_cpu.RMSNorm) for m in norms)
    assert {ptr for _, ptr in seen} == {m.weight.data_ptr() for m in norms}
    assert {rows for rows, _ in seen} >= {3 * 12, 3}  # the prompts' prefill, then the 3 rows' decoding steps


def test_compiled_graphs_call_the_kernel_as_an_operator_with_the_same_result():
    """torch.compile traces the call as efftx::cpu_rms_norm (a graph capture lists it), so compiled passes compute
    what eager ones do; with grad on, the graph holds torch's norm instead."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(any(str(node.target).startswith("efftx.cpu_rms_norm") for node in gm.graph.nodes))
        return gm.forward

    norm = rms_norm_cpu.RMSNorm(40, eps=1e-6)
    fn = torch.compile(lambda x: norm(x), backend=capture, fullgraph=True, dynamic=False)
    x = torch.randn(3, 40)
    with torch.no_grad():
        got = fn(x)
        assert torch.equal(got, MODULE.rms_norm(x, norm.weight, 1e-6))
        assert graphs[-1]
    fn(x).sum().backward()
    assert not graphs[-1] and norm.weight.grad is not None
    with torch.no_grad(), rms_norm_cpu.disabled():  # switched off: a guard fails and the graph is traced again
        fn(x)
        assert not graphs[-1]
