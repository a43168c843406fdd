"""The Triton decode attention kernel (efftx/kernels/decode_attention.py) against its torch reference over many
shapes, the reference against a float64 loop, which passes take it, and the model's compiled passes through it.

On a CPU the kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before efftx is
imported), fp32 and fp16 (the interpreter's bf16 ``tl.dot`` is wrong); the model tests let CPU tensors in with
``on_cpu()`` and switch the C++ CPU kernel off, which would take those passes first. On a CUDA machine,
``EFFTX_TRITON_GPU=1 python -m pytest tests/test_decode_attention.py`` runs the compiled kernels on the GPU, bf16
included (bench/gpu_check.py's kernels section does).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from efftx import recipes
from efftx.generation import compiled
from efftx.generation.decode import generate
from efftx.kernels import decode_attention as da
from efftx.kernels import decode_attention_cpu as dac
from efftx.models import build as build_model
from traced import compiled_calls

ON_GPU = os.environ.get("EFFTX_TRITON_GPU") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
pytestmark = pytest.mark.skipif(da.triton is None, reason="triton is not installed (pip install 'efftx[triton]')")


def test_the_kernels_run_here():
    assert da.INTERPRETED != ON_GPU, "the CPU suite interprets the kernels; EFFTX_TRITON_GPU=1 compiles them"


def loop_oracle(q, k_cache, v_cache, lengths, causal):
    """Float64, one (row, token, head) at a time: softmax over the keys that query may see."""
    b, t, h, d = q.shape
    g = h // k_cache.shape[2]
    out = torch.zeros(b, t, h, d, dtype=torch.float64)
    for r in range(b):
        for i in range(t):
            end = int(lengths[r]) + (i + 1 if causal else t)
            for j in range(h):
                keys, values = k_cache[r, :end, j // g].double().cpu(), v_cache[r, :end, j // g].double().cpu()
                w = (keys @ q[r, i, j].double().cpu() * d ** -0.5).softmax(0)
                out[r, i, j] = w @ values
    return out


def case(shape, seed: int, dtype=torch.float32, full: bool = False):
    """q, caches and lengths for (rows, tokens, kv heads, query heads per kv head, head dim, capacity); the keys
    and values past each row's end are NaN (a kernel that reads them returns NaN)."""
    b, t, hkv, g, d, c = shape
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([c - t if full and r == 0 else rng.choice([0, rng.randint(0, c - t)]) for r in range(b)])
    q = (torch.randn(b, t, hkv * g, d, generator=gen) * 2).to(dtype)
    k = torch.randn(b, c, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, c, hkv, d, generator=gen).to(dtype)
    for r, n in enumerate(lengths.tolist()):
        k[r, n + t:] = float("nan")
        v[r, n + t:] = float("nan")
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), lengths.to(DEVICE)


# (rows, tokens per row, kv heads, query heads per kv head, head dim, capacity)
SHAPES = [(1, 1, 1, 1, 16, 16), (1, 1, 6, 1, 32, 256), (2, 1, 2, 2, 64, 200), (3, 2, 2, 3, 16, 40),
          (5, 6, 4, 1, 32, 100), (4, 6, 6, 1, 32, 256), (2, 16, 2, 4, 64, 90), (3, 3, 1, 8, 128, 33),
          (4, 1, 3, 2, 17, 50), (2, 5, 2, 2, 40, 21), (9, 1, 1, 2, 48, 70), (1, 16, 4, 2, 24, 16),
          (2, 4, 2, 1, 80, 300), (3, 7, 3, 1, 1, 30)]


def assert_matches(out, q, k, v, lengths, causal):
    """The kernel's error against the float64 reference within twice the same-dtype reference's, plus a floor."""
    truth = da.decode_attention_reference(q.double(), k.double(), v.double(), lengths, causal)
    ref = da.decode_attention_reference(q, k, v, lengths, causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    budget = 2 * (ref.double() - truth).abs().max().item() + 2e-6
    err = (out.double() - truth).abs().max().item()
    assert err <= budget, (err, budget)


@pytest.mark.parametrize("splits", [None, 3], ids=["auto", "3-splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_matches_the_reference(shape, causal, dtype, splits):
    q, k, v, lengths = case(shape, hash(shape) % 1000, dtype)
    assert_matches(da.decode_attention(q, k, v, lengths, causal, splits=splits), q, k, v, lengths, causal)


def test_lengths_may_be_a_strided_view():
    q, k, v, lengths = case((4, 2, 2, 2, 32, 50), 5)
    strided = torch.stack([lengths, lengths * 0 + 99], 1)[:, 0]  # stride 2
    assert strided.stride(0) == 2
    assert_matches(da.decode_attention(q, k, v, strided, True), q, k, v, lengths, True)


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 64])
def test_every_split_count_gives_the_same_attention(splits):
    """Cut into ranges, rows that end in the first range (or are empty), rows that fill the capacity: the merge
    of the ranges' partial softmaxes is the one softmax."""
    shape = (4, 3, 2, 2, 32, 300)
    q, k, v, lengths = case(shape, 7, full=True)
    assert_matches(da.decode_attention(q, k, v, lengths, True, splits=splits), q, k, v, lengths, True)


def test_the_reference_is_the_float64_loop():
    for shape, causal in ((SHAPES[3], True), (SHAPES[4], False), (SHAPES[9], True)):
        q, k, v, lengths = case(shape, 1)
        want = loop_oracle(q, k, v, lengths, causal)
        got = da.decode_attention_reference(q.double(), k.double(), v.double(), lengths, causal)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)


def test_the_checks_tell_a_wrong_kernel_apart():
    """Power of the comparisons above: a kernel that sees one key too many (the NaN past a row's end) or attends
    without the causal limit fails them."""
    q, k, v, lengths = case((3, 4, 2, 2, 32, 64), 2)
    with pytest.raises(AssertionError):
        assert_matches(da.decode_attention(q, k, v, lengths + 1, True), q, k, v, lengths, True)
    k, v = k.nan_to_num(), v.nan_to_num()
    with pytest.raises(AssertionError):
        assert_matches(da.decode_attention(q, k, v, lengths, False), q, k, v, lengths, True)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "q": a["q"][0]}, "q must be a 4-D tensor"),
    (lambda a: {**a, "v_cache": a["v_cache"][:, :10]}, "differ in shape"),
    (lambda a: {**a, "q": a["q"][..., :8]}, "does not match q"),
    (lambda a: {**a, "q": a["q"][:, :, :3]}, "not a multiple of the cache's 2 kv heads"),
    (lambda a: {**a, "lengths": a["lengths"].float()}, "lengths must be"),
    (lambda a: {**a, "q": a["q"].repeat(1, 5, 1, 1)}, "the kernel takes 1 to 16"),
    (lambda a: {**a, "q": a["q"].half()}, "must share one of"),
    (lambda a: {**a, "splits": 0}, "splits must be >= 1"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :3], "v_cache": a["v_cache"][:, :3]}, "fewer positions than"),
    (lambda a: {**a, "k_cache": a["k_cache"][:, :, :0], "v_cache": a["v_cache"][:, :, :0]}, "0 kv heads"),
])
def test_bad_arguments_raise_naming_them(change, match):
    q, k, v, lengths = case((2, 4, 2, 2, 16, 32), 0)
    args = change({"q": q, "k_cache": k, "v_cache": v, "lengths": lengths})
    with pytest.raises(ValueError, match=match):
        da.decode_attention(**args)


def test_head_dims_past_the_kernels_are_refused():
    with pytest.raises(ValueError, match="head dim 160 exceeds"):
        da.check_args(torch.zeros(1, 1, 2, 160), torch.zeros(1, 8, 2, 160), torch.zeros(1, 8, 2, 160),
                      torch.zeros(1, dtype=torch.long))


# ---------------------------------------------------------------------------------------------- model passes
def device_cache(b, c, hkv, d, dtype=torch.float32, device=DEVICE):
    from efftx.generation.compiled import DeviceKV

    return DeviceKV(torch.zeros(b, c, hkv, d, dtype=dtype, device=device),
                    torch.zeros(b, c, hkv, d, dtype=dtype, device=device),
                    torch.zeros(b, dtype=torch.long, device=device))


def test_which_passes_take_the_kernel():
    q = torch.zeros(2, 1, 4, 16, device=DEVICE)
    cache = device_cache(2, 32, 2, 16)
    with da.on_cpu() if not ON_GPU else torch.no_grad():
        assert da.takes(q, cache)
        assert da.takes(torch.zeros(2, 16, 4, 16, device=DEVICE), cache)
        assert not da.takes(torch.zeros(2, 17, 4, 16, device=DEVICE), cache)  # 17 tokens: SDPA
        assert not da.takes(q.half(), cache)  # dtypes differ
        assert not da.takes(q, object())  # not a device cache
        assert not da.takes(torch.zeros(2, 1, 3, 16, device=DEVICE), cache)  # heads not a multiple
        with da.disabled():
            assert not da.takes(q, cache)
        with torch.enable_grad():
            assert not da.takes(q.requires_grad_(), cache)
    if not ON_GPU:
        assert not da.takes(q, cache)  # a CPU tensor outside on_cpu(): the C++ kernel's, or the matmuls


def test_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(da, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with da.on_cpu():
            pass


def lm(depth: int = 2):
    """lm_debug (GQA: 4 heads, 2 kv heads), matrices redrawn wide so that a wrong cache changes tokens."""
    torch.manual_seed(0)
    model = build_model(recipes.get("lm_debug").override({"model.depth": depth})).eval().to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 2 * p.shape[1] ** -0.5)
    return model


@pytest.fixture
def triton_path():
    """Cached passes take the Triton kernel, eager ones over a KVCache included (everywhere(); on a CPU:
    interpreted, the C++ kernel off); -> the shapes of the passes it attended."""
    calls = []
    real = da._launch

    def spy(q, *args):
        calls.append(tuple(q.shape))
        return real(q, *args)

    da._launch, before = spy, da._launch
    try:
        with dac.disabled(), da.everywhere(), (da.on_cpu() if not ON_GPU else torch.no_grad()):
            yield calls
    finally:
        da._launch = before


def test_the_model_over_a_device_cache_attends_through_the_kernel(triton_path):
    """Every layer of a pass over compiled decoding's cache goes to the kernel, with the logits of the same pass
    over an eager KVCache, and the pass's keys land in the buffers at each row's position."""
    model = lm(depth=3)
    spec = model.blocks[0].attention.spec
    prompt = torch.randint(0, 256, (2, 6), device=DEVICE)
    with torch.no_grad():
        with da.disabled():  # the eager path on SDPA: the reference
            eager = model.new_cache(2, 64)
            model(prompt, cache=eager)
            device = compiled.new_cache(model, 2, 64)
            device.load(eager, [6, 6])
            step = torch.tensor([[3, 9], [4, 1]], device=DEVICE)
            want = model(step, cache=eager)
        got = model.logits(step, device)
    assert triton_path == [(2, 2, spec.heads, spec.head_dim)] * 3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(device.layers, eager.layers):
        torch.testing.assert_close(mine.k[:, :8], theirs.k[:, :8], rtol=1e-5, atol=1e-5)


def test_a_compiled_pass_calls_the_operator():
    """Under torch.compile(fullgraph=True) the pass is the operator efftx::gpu_decode_attention, a graph node,
    with the eager call's output; switched off, no operator is traced."""
    from efftx.generation.compiled import DeviceKV

    q, k, v, lengths = case((3, 2, 2, 2, 32, 40), 4)
    k, v = k.nan_to_num(), v.nan_to_num()
    k_new, v_new = k[:, :2].clone(), v[:, :2].clone()

    def attend(q, k_new, v_new, cache):
        return da.attend_device(q, k_new, v_new, cache, True)

    with da.on_cpu() if not ON_GPU else torch.no_grad(), torch.no_grad():
        want = attend(q, k_new, v_new, DeviceKV(k.clone(), v.clone(), lengths))
        got, seen = compiled_calls(attend, q, k_new, v_new, DeviceKV(k.clone(), v.clone(), lengths))
        assert any("gpu_decode_attention" in s for s in seen), seen
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        with da.disabled():
            got, seen = compiled_calls(attend, q, k_new, v_new, DeviceKV(k.clone(), v.clone(), lengths))
        assert got is None and not any("gpu_decode_attention" in s for s in seen)


@pytest.mark.slow
def test_compiled_decoding_through_the_kernel_gets_the_eager_tokens(triton_path):
    """generate(compile="on") with the kernel in its compiled steps (inductor calls the operator): ragged prompts,
    greedy and sampled, the eager path's tokens."""
    model = lm()
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    with dac.disabled():
        eager = generate(model, prompts, 12, temperature=0.0)
        sampled = generate(model, prompts, 12, temperature=0.9, top_k=50, seed=3)
    torch._dynamo.reset()
    assert torch.equal(generate(model, prompts, 12, temperature=0.0, compile="on"), eager)
    assert torch.equal(generate(model, prompts, 12, temperature=0.9, top_k=50, seed=3, compile="on"), sampled)
    # the compiled steps' passes, beside the eager prefill's (a KVCache of the ragged prompts: 9 tokens per row)
    assert {shape[:2] for shape in triton_path} == {(2, 1), (2, 9)}, triton_path
    torch._dynamo.reset()


def test_eager_decoding_over_kv_caches_takes_the_kernel_and_gets_the_sdpa_paths_tokens(triton_path):
    """Without compile, decoding keeps a KVCache (the host holds the row lengths): its few-token passes (ragged
    prompts of up to 16 tokens, one-token steps, speculative verify passes of gamma + 1) go through the kernel,
    with the tokens the SDPA path gives (greedy, and seeded sampling)."""
    from efftx.generation.speculative import speculative_generate

    target, draft = lm(), lm(depth=1)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]
    with da.disabled():
        want = generate(target, prompts, 10, temperature=0.0)
        sampled = generate(target, prompts, 10, temperature=0.9, top_k=50, seed=3)
        spec, stats = speculative_generate(target, draft, prompts, 10, gamma=3, temperature=0.0)
    assert not triton_path
    assert torch.equal(generate(target, prompts, 10, temperature=0.0), want)
    assert torch.equal(generate(target, prompts, 10, temperature=0.9, top_k=50, seed=3), sampled)
    got, got_stats = speculative_generate(target, draft, prompts, 10, gamma=3, temperature=0.0)
    assert got == spec and got_stats.accepted == stats.accepted
    assert {shape[1] for shape in triton_path} >= {1, 4, 9}  # steps, verify passes, the ragged prompts' prefill


@pytest.mark.skipif(ON_GPU, reason="the scheduler's test models live on the CPU; on a GPU the eager decoding test "
                    "and bench/gpu_check.py's serveload section run these passes")
def test_continuous_batching_through_the_kernel_gives_every_request_its_solo_output(triton_path):
    """The scheduler's eager slots (rows joining and leaving, lanes of different lengths, base and speculative
    rows) attend through the kernel; each request gets the tokens and acceptance the SDPA path gives it alone."""
    from test_serve_continuous import MIXED, assert_alone, run_rounds
    from test_serve_continuous import lm as serve_lm

    from efftx.serving.continuous import Scheduler

    target, draft = serve_lm(0), serve_lm(1, 1)
    jobs = run_rounds(Scheduler(target, draft, max_rows=8, short_tokens=0), MIXED[:4])
    assert max(j.batch_size for j in jobs) > 1 and {shape[1] for shape in triton_path} >= {1, 4}  # steps, verify
    with da.disabled():
        assert_alone(target, draft, jobs)


def test_kv_cache_rows_that_do_not_fit_raise_and_leave_the_cache_as_it_was():
    from efftx.attention.cache import KVCache

    cache = KVCache(3, 20, 2, 16, device=DEVICE)
    cache.k.normal_()
    cache.lengths = [3, 17, 0]  # 17 + 4 > 20
    k0 = cache.k.clone()
    q, k = torch.randn(3, 4, 4, 16, device=DEVICE), torch.randn(3, 4, 2, 16, device=DEVICE)
    with da.on_cpu() if not ON_GPU else torch.no_grad(), torch.no_grad():
        assert da.takes(q, cache, k) and da.attend(q, k, k, cache, True) is None  # eager passes: opt-in
        with da.everywhere(), pytest.raises(ValueError, match="overflow"):
            da.attend(q, k, k, cache, True)
    assert cache.lengths == [3, 17, 0] and torch.equal(cache.k, k0)


# ---------------------------------------------------------------------------------------------- a GPU target
_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import os, subprocess, sys, tempfile
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from efftx.kernels.decode_attention import INTERPRETED, _merge_kernel, _partial_kernel, launch_shape

    assert not INTERPRETED
    ptxas = sys.argv[2]
    dtypes = dict(fp16=torch.float16, bf16=torch.bfloat16, fp32=torch.float32)
    for case in sys.argv[1].split(","):
        name, t, g, d = case.split(":")
        meta = launch_shape(int(t), int(g), 1, int(d), dtypes[name])
        warps = meta.pop("num_warps")
        ptr = "*" + name
        precision = "ieee" if name == "fp32" else "tf32"
        for kernel, consts in (
                (_partial_kernel, dict(meta, HKV=2, CAUSAL=True, DIRECT=False, PRECISION=precision)),
                (_partial_kernel, dict(meta, HKV=2, CAUSAL=False, DIRECT=True, PRECISION=precision)),
                (_merge_kernel, dict(HKV=2, **{k: meta[k] for k in ("G", "M_PAD", "D", "D_PAD")}))):
            consts = {n: consts[n] for n in kernel.arg_names if n in consts}
            pointers = dict(Q=ptr, K=ptr, V=ptr, O=ptr, LEN="*i64", M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32",
                            M_IN="*fp32", L_IN="*fp32", ACC_IN="*fp32")
            sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "scale" else "i32")
                   for n in kernel.arg_names}
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=warps))
            assert compiled.asm["cubin"], kernel
            with tempfile.TemporaryDirectory() as tmp:  # registers and spills, as ptxas reports them
                path = os.path.join(tmp, "k.ptx")
                open(path, "w").write(compiled.asm["ptx"])
                info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                                      capture_output=True, text=True).stderr
            spills = int(info.split(" bytes spill stores")[0].rsplit(None, 1)[-1])
            assert spills <= 64, (kernel.__name__, case, info)  # at most a few values in local memory
            print("compiled", kernel.__name__, case, "shared", compiled.metadata.shared, "spilled", spills, flush=True)
    """
)


def newest_ptxas() -> str | None:
    """The newest ptxas this triton ships (its PTX may be newer than the older one's)."""
    root = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin")
    found = [os.path.join(root, name) for name in ("ptxas-blackwell", "ptxas") if os.path.isfile(os.path.join(root, name))]
    return found[0] if found else None


@pytest.mark.slow
def test_the_kernels_compile_for_an_h100_without_a_gpu_and_spill_next_to_no_registers(tmp_path):
    ptxas = newest_ptxas()
    if ptxas is None:
        pytest.skip("this triton build ships no NVIDIA backend tools (ptxas)")
    # (dtype, tokens per row, query heads per kv head, head dim): decoding and verify passes, each head dim bucket,
    # and the largest tile each dtype takes (tile_rows)
    cases = ["fp16:1:1:64", "bf16:6:4:128", "fp32:1:8:32", "bf16:16:1:16", "fp16:6:1:128", "bf16:1:2:80",
             "bf16:16:4:128", "fp16:8:8:64", "fp32:16:2:128", "fp32:16:4:64"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, no cache hit from an earlier run
    run = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, ",".join(cases), ptxas], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("compiled") == 3 * len(cases), run.stdout


def test_tiles_past_what_the_kernel_takes_go_to_sdpa():
    """A pass whose tokens x query heads per kv head exceed tile_rows (64; 32 in float32 past head dim 64) is refused
    by decode_attention, naming the sizes, and not taken by the model's passes."""
    q = torch.zeros(1, 16, 8, 64, dtype=torch.float16, device=DEVICE)  # 16 tokens x 8 heads of one kv head: 128
    k = torch.zeros(1, 32, 1, 64, dtype=torch.float16, device=DEVICE)
    lengths = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="128 tile rows exceed the kernel's 64"):
        da.decode_attention(q, k, k, lengths)
    wide = torch.zeros(1, 16, 4, 128, device=DEVICE)  # float32, head dim 128: 64 rows > 32
    with pytest.raises(ValueError, match="64 tile rows exceed the kernel's 32 for float32 at head dim 128"):
        da.decode_attention(wide, torch.zeros(1, 32, 1, 128, device=DEVICE), torch.zeros(1, 32, 1, 128, device=DEVICE),
                            lengths)
    with da.on_cpu() if not ON_GPU else torch.no_grad():
        assert not da.takes(q, device_cache(1, 32, 1, 64, torch.float16))
        assert da.takes(q[:, :8], device_cache(1, 32, 1, 64, torch.float16))  # 64 rows


# ---------------------------------------------------------------------------------------------- the bench
@pytest.mark.skipif(ON_GPU, reason="on a GPU the bench itself runs (bench/gpu_check.py --only decodeattn)")
def test_the_bench_runs_both_paths_side_by_side_and_marks_its_goals():
    """bench/decode_attention.py's plumbing through the interpreter (times meaningless, goals not judged): compiled
    steps both ways per shape, the attention alone, every goal line present."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.path.join(repo, "platform")}
    run = subprocess.run([sys.executable, os.path.join(repo, "bench", "decode_attention.py"), "--recipe", "lm_debug",
                          "--depth", "1", "--capacity", "128", "--batches", "2", "--fills", "8,64", "--tokens", "1",
                          "--steps", "1", "--repeats", "1", "--device", "cpu"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    steps = [line.split() for line in lines if line.startswith("    2      1")]
    # compiled steps, eager passes over a KVCache, the attention alone
    assert [row[2] for row in steps] == ["8", "64"] * 3
    assert ">= 1.5x: not judged" in run.stdout and ">= 0.9x: not judged" in run.stdout
    assert lines[-1] == "goals: 0 of 4 met (not judged: no GPU)"
    bad = subprocess.run([sys.executable, os.path.join(repo, "bench", "decode_attention.py"), "--capacity", "64",
                          "--fills", "60", "--device", "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "exceed --capacity 64" in bad.stderr
