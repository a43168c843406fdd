"""The C++ CPU kernel of full attention's few-token cached passes (efftx/kernels/decode_attention_cpu.cpp) against a
float64 softmax over many shapes and against the torch path it replaces (SDPA), and which passes take it."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from efftx import recipes
from efftx.attention.cache import KVCache, visible_keys
from efftx.generation.decode import Rows, generate
from efftx.kernels import decode_attention_cpu as dac
from efftx.models import build as build_model
from traced import compiled_calls

MODULE = dac.kernel()
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_kernel_builds_here():
    assert MODULE is not None, dac.KERNEL.load()[1]


def reference(q, k_new, v_new, cache: KVCache, causal: bool):
    """Float64: the new keys/values at each row's position, then softmax over the keys each query may see."""
    b, t, h, d = q.shape
    hkv = k_new.shape[2]
    before = list(cache.lengths)
    k, v = cache.k.double().clone(), cache.v.double().clone()
    for r in range(b):
        k[r, before[r]:before[r] + t] = k_new[r].double()
        v[r, before[r]:before[r] + t] = v_new[r].double()
    end = max(before) + t
    keys = k[:, :end].repeat_interleave(h // hkv, 2).transpose(1, 2)  # (B, H, L, D)
    values = v[:, :end].repeat_interleave(h // hkv, 2).transpose(1, 2)
    scores = q.double().transpose(1, 2) @ keys.transpose(-1, -2) * d ** -0.5
    scores = scores.masked_fill(~visible_keys(before, t, causal, q.device)[:, None], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2), k, v


def case(seed: int, b: int, t: int, hkv: int, g: int, d: int, capacity: int, causal: bool, full: bool = False):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(b, capacity, hkv, d)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.lengths = [capacity - t if full and r == 0 else rng.randint(0, capacity - t) for r in range(b)]
    q = torch.randn(b, t, hkv * g, d, generator=gen) * 2
    return q, torch.randn(b, t, hkv, d, generator=gen), torch.randn(b, t, hkv, d, generator=gen), cache


# (rows, new tokens per row, kv heads, query heads per kv head, head dim, capacity, causal)
SHAPES = [(1, 1, 1, 1, 8, 4, True), (1, 1, 6, 1, 32, 256, True), (2, 1, 6, 1, 32, 64, True),
          (3, 2, 2, 3, 16, 40, True), (5, 6, 4, 1, 32, 100, True), (16, 1, 6, 1, 32, 256, True),
          (16, 6, 6, 1, 32, 256, True), (7, 16, 2, 4, 64, 90, True), (4, 3, 1, 8, 128, 33, True),
          (9, 1, 3, 2, 17, 50, True), (2, 5, 2, 2, 40, 21, True), (33, 1, 1, 2, 48, 70, True),
          (1, 16, 4, 2, 24, 16, True), (6, 4, 2, 1, 80, 300, True), (3, 7, 3, 1, 1, 30, True),
          (1, 1, 6, 1, 32, 256, False), (4, 6, 2, 2, 32, 64, False), (8, 16, 1, 4, 16, 40, False),
          (2, 3, 3, 3, 20, 10, False), (11, 2, 4, 1, 64, 130, False),
          # prefills of longer prompts, up to MAX_QUERIES tokens a row
          (1, 17, 6, 1, 32, 40, True), (3, 45, 2, 2, 32, 100, True), (2, 128, 1, 4, 64, 140, True),
          (2, 77, 3, 1, 16, 90, False)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + ("c" if s[6] else "n"))
@pytest.mark.parametrize("full", [False, True], ids=["some", "to-capacity"])
def test_the_kernel_matches_a_float64_softmax_and_writes_the_new_rows_in_place(shape, full):
    q, k_new, v_new, cache = case(len(SHAPES) + SHAPES.index(shape), *shape, full=full)
    before = list(cache.lengths)
    want, keys, values = reference(q, k_new, v_new, cache, shape[-1])
    with torch.no_grad():
        got = dac.attend(q, k_new, v_new, cache, shape[-1])
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
    assert torch.equal(cache.k.double(), keys) and torch.equal(cache.v.double(), values)  # nothing else touched
    assert cache.lengths == [n + shape[1] for n in before]


def test_a_row_is_bit_for_bit_the_same_alone_and_among_rows_of_other_lengths():
    q, k_new, v_new, cache = case(7, 9, 4, 2, 3, 40, 120, True)
    k0, v0, before = cache.k.clone(), cache.v.clone(), list(cache.lengths)
    with torch.no_grad():
        batch = dac.attend(q, k_new, v_new, cache, True)
        for r in [4, 0, 8]:
            alone = KVCache(1, 120, 2, 40)
            alone.k.copy_(k0[r:r + 1])
            alone.v.copy_(v0[r:r + 1])
            alone.lengths = [before[r]]
            got = dac.attend(q[r:r + 1], k_new[r:r + 1], v_new[r:r + 1], alone, True)
            assert torch.equal(got[0], batch[r])


def test_causal_and_full_visibility_differ_where_they_should():
    """A kernel that ignored ``causal`` (or shifted the causal edge by one key) would fail one of these."""
    q, k_new, v_new, cache = case(3, 2, 5, 1, 2, 16, 30, True)
    snap = (cache.k.clone(), cache.v.clone(), list(cache.lengths))

    def run(causal):
        cache.k.copy_(snap[0])
        cache.v.copy_(snap[1])
        cache.lengths = list(snap[2])
        with torch.no_grad():
            return dac.attend(q, k_new, v_new, cache, causal)

    causal, full = run(True), run(False)
    assert torch.equal(causal[:, -1], full[:, -1])  # the last new token sees every key either way
    assert not torch.allclose(causal[:, 0], full[:, 0])


def test_rows_that_do_not_fit_raise_and_leave_the_cache_as_it_was():
    q, k_new, v_new, cache = case(5, 3, 4, 1, 1, 8, 20, True)
    cache.lengths = [3, 17, 0]  # 17 + 4 > 20
    k0 = cache.k.clone()
    with pytest.raises(ValueError, match="overflow"), torch.no_grad():
        dac.attend(q, k_new, v_new, cache, True)
    assert cache.lengths == [3, 17, 0] and torch.equal(cache.k, k0)


def lm(depth: int = 2, **over):
    cfg = recipes.get("lm_debug").override({"model.depth": depth, **over})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(5)  # sharper predictions, so a wrong cache changes tokens
    return model


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = MODULE.attend

    class Spy:
        def attend(self, q, *args):
            calls.append(tuple(q.shape))
            return real(q, *args)

    monkeypatch.setattr(dac, "kernel", lambda: Spy())
    return calls


def test_which_passes_take_the_kernel(spy):
    model = lm()
    prompt = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        generate(model, prompt, 4, temperature=0.0)
    assert spy and all(s[1] <= dac.MAX_QUERIES for s in spy)
    depth = len(model.blocks)
    assert [s[1] for s in spy] == [5] * depth + [1] * 3 * depth  # the prompt's pass, then one token per step
    spy.clear()
    longer = lm(**{"model.max_seq_len": 2 * dac.MAX_QUERIES})
    with torch.no_grad():
        generate(longer, torch.randint(0, 256, (2, dac.MAX_QUERIES)), 2, temperature=0.0)
        assert [s[1] for s in spy] == [dac.MAX_QUERIES] * depth + [1] * depth  # a prompt of MAX_QUERIES tokens
        spy.clear()
        generate(longer, torch.randint(0, 256, (2, dac.MAX_QUERIES + 1)), 2, temperature=0.0)
    assert all(s[1] == 1 for s in spy) and len(spy) == depth  # a longer prompt: SDPA; then a step
    spy.clear()
    model.train()
    model(torch.randint(0, 256, (2, 8))).sum().backward()  # training: no cache, never the kernel
    model.eval()
    with torch.no_grad():
        cache = model.new_cache(1, 32)
        model(prompt, cache=cache)
        assert len(spy) == depth
        spy.clear()
        with dac.disabled():
            model(prompt[:, :1], cache=cache)
        bf16 = lm().to(torch.bfloat16)
        bf16(prompt, cache=bf16.new_cache(1, 32))
    assert not spy


def test_decoding_with_the_kernel_gets_the_torch_paths_tokens_and_logits():
    model = lm(depth=3)
    prompts = [[5, 6, 7], [9] * 12, [1], [3, 1, 4, 1, 5, 9, 2, 6]]
    with torch.no_grad():
        ours = generate(model, prompts, 12, temperature=0.0)
        with dac.disabled():
            theirs = generate(model, prompts, 12, temperature=0.0)
        assert torch.equal(ours, theirs)
        rows = {}
        for off in (False, True):
            r = Rows(model, len(prompts), 64)
            with dac.disabled() if off else torch.no_grad():
                first = r.prefill(prompts)
                step = r.forward(torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]))  # ragged rows, two tokens each
            rows[off] = (first, step)
        for ours, theirs in zip(rows[False], rows[True]):  # float32 rounding, amplified by the sharpened weights
            scale = theirs.abs().max().item()
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * scale)


def test_an_unbuildable_kernel_falls_back_to_sdpa_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(dac.KERNEL, "load", lambda: (None, "RuntimeError: no C++ compiler"))
    dac.KERNEL.warned.clear()
    model = lm()
    prompt = torch.randint(0, 256, (1, 6))
    with caplog.at_level("WARNING", logger=dac.__name__), torch.no_grad():
        cache = model.new_cache(1, 16)
        got = model(prompt, cache=cache)
    assert "decode attention kernel is unavailable (RuntimeError: no C++ compiler)" in caplog.text
    assert cache.lengths == [6]  # grown once, by the torch path
    with dac.disabled(), torch.no_grad():
        torch.testing.assert_close(got, model(prompt, cache=model.new_cache(1, 16)))
    with pytest.raises(RuntimeError, match="could not be built: RuntimeError: no C"):
        dac.build(log_line=lambda line: None)
    dac.KERNEL.warned.clear()


@pytest.mark.parametrize("shape", [(1, 1, 6, 1, 32, 256), (5, 6, 2, 3, 16, 40), (16, 1, 6, 1, 32, 256),
                                   (3, 16, 1, 4, 64, 90), (2, 3, 4, 1, 2, 12)], ids=lambda s: "x".join(map(str, s)))
def test_rotary_inside_the_kernel_is_bit_for_bit_the_modules(shape):
    """q and the new keys rotated in the kernel at each row's positions equal the Rotary module's rotation followed
    by the kernel without it: outputs and cache contents, bit for bit."""
    from efftx.models.layers import Rotary

    rot = Rotary(shape[4], shape[5])
    q, k_new, v_new, fused = case(11, *shape, True)
    plain = KVCache(*fused.k.shape[:1], fused.k.shape[1], fused.k.shape[2], fused.k.shape[3])
    plain.k.copy_(fused.k)
    plain.v.copy_(fused.v)
    plain.lengths = list(fused.lengths)
    offset = torch.tensor(fused.lengths)[:, None]
    with torch.no_grad():
        got = dac.attend(q, k_new, v_new, fused, True, rot)
        rq, rk = rot.pair(q, k_new, offset)
        want = dac.attend(rq, rk, v_new, plain, True)
    assert torch.equal(got, want) and torch.equal(fused.k, plain.k) and torch.equal(fused.v, plain.v)


def test_the_model_hands_rotation_to_the_kernel_and_decodes_as_without_it(monkeypatch):
    calls = []
    real = MODULE.attend

    class Spy:
        def attend(self, *args):
            calls.append(len(args))
            return real(*args)

    monkeypatch.setattr(dac, "kernel", lambda: Spy())
    model = lm(depth=2)
    prompts = [[5, 6, 7], [9] * 12, [1]]
    with torch.no_grad():
        ours = Rows(model, 3, 40)
        first = ours.prefill(prompts)
        steps = [ours.forward(torch.tensor([[1], [2], [3]]))]
        assert calls and all(n == 10 for n in calls)  # the rotary tables went in: every pass rotated in the kernel
        with dac.disabled():
            theirs = Rows(model, 3, 40)
            torch.testing.assert_close(first, theirs.prefill(prompts), rtol=0, atol=1e-5 * first.abs().max().item())
            torch.testing.assert_close(steps[0], theirs.forward(torch.tensor([[1], [2], [3]])), rtol=0,
                                       atol=1e-5 * steps[0].abs().max().item())


# ---------------------------------------------------------------------------------------------- compiled decoding
def device_case(shape, seed: int):
    """A compiled-decoding cache (DeviceKV: the buffers and a device lengths tensor) with the same content as
    :func:`case`'s KVCache."""
    from efftx.generation.compiled import DeviceKV

    q, k_new, v_new, cache = case(seed, *shape)
    device = DeviceKV(cache.k.clone(), cache.v.clone(), torch.tensor(cache.lengths, dtype=torch.long))
    return q, k_new, v_new, cache, device


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + ("c" if s[6] else "n"))
def test_the_operator_on_a_device_cache_matches_a_float64_softmax(shape):
    """Compiled decoding's call (``efftx::cpu_decode_attention`` over a DeviceKV, lengths a tensor): the float64
    reference's output and cache writes, its lengths left for the caller to advance, and the same output as the
    torch path compiled decoding takes without it (the keys written, attention over the whole capacity)."""
    from efftx.attention.full import few_query_attention

    q, k_new, v_new, cache, device = device_case(shape, 7 + SHAPES.index(shape))
    before = list(cache.lengths)
    want, keys, values = reference(q, k_new, v_new, cache, shape[-1])
    torch_path = DeviceKVcopy(device)
    with torch.no_grad():
        got = dac.attend_device(q, k_new, v_new, device, shape[-1])
        k, v, mask = torch_path.append_rows(k_new, v_new, shape[-1])
        plain = few_query_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None])
    assert got is not None and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got, plain.transpose(1, 2), rtol=1e-5, atol=2e-6)
    assert torch.equal(device.k.double(), keys) and torch.equal(device.v.double(), values)
    assert device.lengths.tolist() == before  # DeviceCache.advance moves them, once per pass


def DeviceKVcopy(device):
    from efftx.generation.compiled import DeviceKV

    return DeviceKV(device.k.clone(), device.v.clone(), device.lengths.clone())


def test_a_compiled_pass_calls_the_operator_and_attends_over_each_rows_own_keys():
    """Under torch.compile the device cache's pass is the operator (a graph node, no Python), with the eager
    call's output and writes; keys past a row's length (garbage here) never reach it. With the kernel switched
    off no operator is traced (the caller's torch path runs instead)."""
    shape = (5, 3, 2, 3, 16, 40, True)
    q, k_new, v_new, _, device = device_case(shape, 3)
    lengths = device.lengths.clone()
    for r, n in enumerate(lengths.tolist()):  # what lies past each row's keys must not matter
        device.k[r, n + 3:] = float("nan")
        device.v[r, n + 3:] = 1e6
    eager = DeviceKVcopy(device)
    with torch.no_grad():
        want = dac.attend_device(q, k_new, v_new, eager, True)
    assert torch.isfinite(want).all()

    def attend(q, k_new, v_new, cache):
        return dac.attend_device(q, k_new, v_new, cache, True)

    with torch.no_grad():
        got, seen = compiled_calls(attend, q, k_new, v_new, device)
    assert any("cpu_decode_attention" in s for s in seen), seen
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(device.k.nan_to_num(), eager.k.nan_to_num()) and torch.equal(device.v, eager.v)
    with dac.disabled(), torch.no_grad():
        got, seen = compiled_calls(attend, q, k_new, v_new, DeviceKVcopy(eager))
    assert got is None and not any("cpu_decode_attention" in s for s in seen)


def test_the_model_over_a_device_cache_attends_through_the_operator(monkeypatch):
    """Full attention hands a pass over compiled decoding's cache to :func:`attend_device` (every layer, the
    rotated queries and keys), with the logits of the same pass over an eager KVCache."""
    from efftx.generation.compiled import new_cache

    model = lm(depth=3)
    prompt = torch.randint(0, 256, (2, 6))
    calls = []
    real = dac.attend_device

    def spy(q, *args):
        out = real(q, *args)
        calls.append((tuple(q.shape), out is not None))
        return out

    monkeypatch.setattr(dac, "attend_device", spy)
    with torch.no_grad():
        eager = model.new_cache(2, 64)
        model(prompt, cache=eager)
        device = new_cache(model, 2, 64)
        device.load(eager, [6, 6])
        step = torch.tensor([[3], [4]])
        want = model(step, cache=eager)
        got = model.logits(step, device)
    assert calls == [((2, 1, model.blocks[0].attention.spec.heads, model.blocks[0].attention.spec.head_dim), True)] * 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 6, 6, 1, 32), (2, 5, 2, 3, 40), (2, 7, 1, 4, 64), (1, 4, 2, 2, 160),
                                   (4, 3, 3, 1, 17)], ids=lambda s: "x".join(map(str, s)))
def test_a_new_token_is_bit_for_bit_the_same_fed_alone_or_among_the_passs_tokens(shape):
    """The kernel takes a pass's queries several at a time (their weighted sums of the values together); a speculative
    verify pass of gamma + 1 tokens must give each token exactly what a one-token decoding step at its position
    gives (greedy speculative output equals base decoding), whatever its query's neighbours see."""
    b, t, hkv, g, d = shape
    q, k_new, v_new, cache = case(11, b, t, hkv, g, d, 90, True)
    k0, v0, before = cache.k.clone(), cache.v.clone(), list(cache.lengths)
    with torch.no_grad():
        together = dac.attend(q, k_new, v_new, cache, True)
        cache.k.copy_(k0)
        cache.v.copy_(v0)
        cache.lengths = list(before)
        for i in range(t):  # one token at a time, as decoding steps feed them
            one = dac.attend(q[:, i:i + 1].contiguous(), k_new[:, i:i + 1].contiguous(),
                             v_new[:, i:i + 1].contiguous(), cache, True)
            assert torch.equal(one[:, 0], together[:, i]), f"token {i}"


@pytest.mark.parametrize("shape", SHAPES + [(3, 6, 2, 3, 160, 70, True), (2, 9, 1, 1, 16, 200, False)],
                         ids=lambda s: "x".join(map(str, s[:6])) + ("c" if s[6] else "n"))
def test_the_blocked_kernel_is_bit_for_bit_its_key_by_key_reference(shape):
    """Scores 16 keys at a time and queries four at a time through the values (with rotary in the kernel too) give
    exactly what every score and every query on its own gives: outputs and cache contents."""
    from efftx.models.layers import Rotary

    rot = Rotary(shape[4], shape[5]) if shape[4] % 2 == 0 else None
    runs = []
    for reference in (False, True):
        q, k_new, v_new, cache = case(23 + SHAPES.index(shape) if shape in SHAPES else 5, *shape)
        with torch.no_grad(), (dac.key_by_key() if reference else contextlib.nullcontext()):
            runs.append((dac.attend(q, k_new, v_new, cache, shape[-1], rot), cache.k, cache.v))
    (got, k, v), (want, k_ref, v_ref) = runs
    assert got is not None and torch.equal(got, want) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert MODULE.set_blocked(True) is True  # the switch is back where it was

