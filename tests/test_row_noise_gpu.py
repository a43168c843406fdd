"""The Triton row noise kernel (efftx/kernels/row_noise_gpu.py) against its torch reference
(efftx.kernels.row_noise.row_noise_reference): the integer bits exactly, the noise within a few units in the last
place (the log's), over many shapes; a row's values whatever the width asked for and whatever else is in the batch;
which calls take it; bad arguments; the operator under torch.compile; and the kernel compiled for an sm_90 target
without a GPU.

On a CPU the kernel runs through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before efftx is
imported; :func:`on_cpu` lets CPU tensors in). On a CUDA machine, ``EFFTX_TRITON_GPU=1 python -m pytest
tests/test_row_noise_gpu.py`` runs the compiled kernel on the GPU.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from efftx.kernels import row_noise as rn
from efftx.kernels.cpu_build import switch
from efftx.kernels import row_noise_gpu as g

ON_GPU = os.environ.get("EFFTX_TRITON_GPU") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(g.triton is None, reason="triton is not installed (pip install 'efftx[triton]')")
# The noise's tolerance: the log's last places only. torch's float32 log is within one unit in the last place of
# the true value, numpy's (the interpreter's tl.log) within about four: over all 2**23 inputs the two differ by
# at most 3.3e-7 relatively. The integer bits, which this cannot see below a few units of x >> 9, are compared
# exactly (row_bits).
RTOL = 1e-6
ROWS = (1, 2, 5, 16, 33)
WIDTHS = (0, 1, 7, 256, 257, 1542, 3000)


def kernel_here():
    """The context in which this device's tensors take the kernel (the interpreter needs on_cpu())."""
    return contextlib.nullcontext() if ON_GPU else g.on_cpu()


def random_keys(rows: int, seed: int) -> torch.Tensor:
    """(rows, 2) int64 keys in [0, 2**32), the extremes 0 and 2**32 - 1 among them."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2 ** 32, (rows, 2), generator=gen, dtype=torch.int64)
    edges = torch.tensor([[0, 0], [2 ** 32 - 1, 2 ** 32 - 1], [0, 2 ** 32 - 1], [2 ** 32 - 1, 0], [2 ** 31, 2 ** 31 - 1]])
    n = min(rows, len(edges))
    keys[:n] = edges[(torch.arange(n) + seed) % len(edges)]
    return keys.to(DEVICE)


def test_the_kernel_runs_here():
    assert g.INTERPRETED != ON_GPU, "the CPU suite interprets the kernel; EFFTX_TRITON_GPU=1 compiles it"


@pytest.mark.parametrize("width", WIDTHS)
def test_the_kernel_matches_the_reference_bits_exactly_and_noise_to_the_logs_last_places(width):
    for seed, rows in enumerate(ROWS):
        keys = random_keys(rows, seed)
        bits = g.row_bits(keys, width)
        assert bits.shape == (rows, width) and bits.dtype == torch.int64
        assert torch.equal(bits, rn.row_bits(keys, width)), (rows, width)
        out = g.row_noise(keys, width)
        ref = rn.row_noise_reference(keys, width)
        assert out.shape == (rows, width) and out.dtype == torch.float32 and out.device == keys.device
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=0)
        if width:
            assert bool((out > 0).all()) and bool(torch.isfinite(out).all())  # u in (0, 1): E never 0 or inf


def test_the_comparison_would_catch_a_wrong_constant(monkeypatch):
    """The reference with one bit of a multiplier flipped differs from the kernel in nearly every element, by far
    more than the tolerance; a kernel built with it (the interpreter reads its constants at each call) fails."""
    keys = random_keys(5, 7)
    out = g.row_noise(keys, 257)
    for name in ("C1", "C2"):
        with monkeypatch.context() as m:
            m.setattr(rn, name, getattr(rn, name) ^ 4)
            wrong = rn.row_noise_reference(keys, 257)
        off = ((out - wrong).abs() > RTOL * wrong.abs()).float().mean().item()
        assert off > 0.99, (name, off)
        assert ((out - wrong).abs() / wrong).median() > 1000 * RTOL
    if g.INTERPRETED:
        with monkeypatch.context() as m:
            m.setattr(g, "_C2", g.tl.constexpr(rn.C2 ^ 4))
            assert not torch.equal(g.row_bits(keys, 257), rn.row_bits(keys, 257))
            with pytest.raises(AssertionError):
                torch.testing.assert_close(g.row_noise(keys, 257), rn.row_noise_reference(keys, 257), rtol=RTOL,
                                           atol=0)
    assert torch.equal(g.row_bits(keys, 257), rn.row_bits(keys, 257))  # the real constant again


def test_a_rows_values_do_not_depend_on_the_width_or_the_other_rows():
    keys = random_keys(6, 3)
    full = g.row_noise(keys, 3000)
    for width in (1, 7, 1024, 1025, 2999):
        assert torch.equal(g.row_noise(keys, width), full[:, :width]), width
    for i in range(len(keys)):
        assert torch.equal(g.row_noise(keys[i:i + 1], 3000), full[i:i + 1]), i
    order = torch.tensor([4, 0, 5, 2, 1, 3], device=keys.device)
    assert torch.equal(g.row_noise(keys[order], 3000), full[order])
    doubled = torch.cat([keys, keys])  # the same key twice: the same values
    assert torch.equal(g.row_noise(doubled, 300), torch.cat([full[:, :300], full[:, :300]]))
    strided = torch.stack([keys[:, 0], keys[:, 1]]).t()  # a transposed view: strides (1, 6)
    assert not strided.is_contiguous() and torch.equal(g.row_noise(strided, 3000), full)
    assert torch.equal(g.row_bits(strided, 3000), rn.row_bits(keys, 3000))


def test_no_rows_or_no_width_give_an_empty_result():
    for rows, width in ((0, 5), (3, 0), (0, 0)):
        keys = torch.zeros(rows, 2, dtype=torch.int64, device=DEVICE)
        out = g.row_noise(keys, width)
        assert out.shape == (rows, width) and out.dtype == torch.float32 and out.device == keys.device


def test_which_calls_take_the_kernel(monkeypatch):
    keys = torch.zeros(3, 2, dtype=torch.int64)
    if not ON_GPU:
        assert not g.takes(keys)  # CPU tensors go to the C++ kernel or the reference
    with kernel_here():
        assert g.takes(keys.to(DEVICE))
        with g.disabled():
            assert not g.takes(keys.to(DEVICE))
        assert g.takes(keys.to(DEVICE))
        assert not g.takes([[0, 0]])
    assert not g.takes(keys)  # outside on_cpu() again
    if g.INTERPRETED:
        monkeypatch.setattr(g, "INTERPRETED", False)  # as a build without TRITON_INTERPRET sees CPU tensors
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            with g.on_cpu():
                pass
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            g.row_noise(keys, 4)


def test_the_switch_off_keeps_every_call_off_the_kernel(monkeypatch):
    """``EFFTX_GPU_ROW_NOISE=off`` (read at import) sets the state :func:`takes` reads, as :func:`disabled` does."""
    assert g.ENV == "EFFTX_GPU_ROW_NOISE"
    for value, enabled in (("off", False), ("0", False), ("no", False), ("auto", True), ("on", True)):
        monkeypatch.setenv(g.ENV, value)
        monkeypatch.setattr(g, "_state", switch(g.ENV))
        with kernel_here():
            assert g.takes(torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)) == enabled, value


@pytest.mark.parametrize("keys, width, match", [
    (torch.zeros(3, 2, dtype=torch.int32), 4, "int64"),
    (torch.zeros(3, 3, dtype=torch.int64), 4, r"shape \(rows, 2\), got torch.int64 \(3, 3\)"),
    (torch.zeros(6, dtype=torch.int64), 4, r"\(6,\)"),
    (torch.zeros(3, 2, dtype=torch.float32), 4, "int64"),
    (torch.zeros(3, 2, dtype=torch.int64), -1, "width must be an integer >= 0"),
    (torch.zeros(3, 2, dtype=torch.int64), True, "width must be an integer >= 0"),
    (torch.zeros(3, 2, dtype=torch.int64), 2.0, "width must be an integer >= 0"),
    (torch.zeros(3, 2, dtype=torch.int64), g.MAX_WIDTH + 1, "exceeds the row noise kernel's"),
])
def test_bad_arguments_raise_naming_the_problem(keys, width, match):
    with pytest.raises(ValueError, match=match):
        g.row_noise(keys.to(DEVICE), width)


def test_torch_compile_traces_the_operator_as_one_node():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def draw(keys):
        return g.row_noise(keys, 1000) * 2.0

    keys = random_keys(4, 11)
    with kernel_here():
        out = torch.compile(draw, backend=backend, fullgraph=True)(keys)
    calls = [node for gm in graphs for node in gm.graph.nodes
             if node.op == "call_function" and "gpu_row_noise" in str(node.target)]
    assert len(graphs) == 1 and len(calls) == 1, [str(gm.graph) for gm in graphs]
    assert torch.equal(out, g.row_noise(keys, 1000) * 2.0)
    torch.library.opcheck(torch.ops.efftx.gpu_row_noise.default, (keys, 300),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------- a GPU target
_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from efftx.kernels.row_noise_gpu import BLOCK, INTERPRETED, NUM_WARPS, _row_noise_kernel as kernel

    assert not INTERPRETED
    for bits in (False, True):
        consts = dict(BLOCK=BLOCK, BITS=bits)
        pointers = dict(KEYS="*i64", OUT="*i64" if bits else "*fp32")
        sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=NUM_WARPS))
        assert compiled.asm["cubin"] and compiled.metadata.num_warps == NUM_WARPS
        ptx = compiled.asm["ptx"]
        # mix32's shifts must be logical (values reach 2**32 - 1), the log the accurate one (not lg2.approx, whose
        # absolute error near u = 1 exceeds -log(u) itself)
        assert "shr.u32" in ptx and "shr.s32" not in ptx, "arithmetic shift in mix32"
        assert "lg2.approx" not in ptx, "approximate log"
        print("compiled", "bits" if bits else "noise", flush=True)
    """
)


def test_the_kernel_compiles_for_an_h100_without_a_gpu(tmp_path):
    bin_dir = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin")
    if not os.path.isdir(bin_dir):
        pytest.skip("this triton build ships no NVIDIA backend tools (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, no cache hit from an earlier run
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(REPO, "platform"), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("compiled") == 2, run.stdout
