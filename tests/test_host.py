"""efftx.host.host_values: host values made into device tensors without waiting for the device (row lengths and
positions of every decoding step's layers, per-row sampling settings, stream keys); efftx.host.Readback: device values
sent to the host as soon as their work is queued, read later without waiting for what was queued after them."""

from __future__ import annotations

import pytest
import torch

from efftx.attention.cache import KVCache, visible_keys
from efftx.generation import compiled
from efftx.host import Readback, host_values
from efftx.generation.decode import iter_generate
from efftx.generation.speculative import iter_speculative_rows
from efftx.serving.batches import BaseEngine, Job, SpeculativeEngine
from efftx.serving.continuous import Scheduler

from device_waits import DeviceWaits, on_device
from test_serve_continuous import GREEDY, HOT, NUCLEUS, lm


def test_host_values_are_torch_tensors_of_them():
    for values, dtype in (([1, 2, 3], torch.long), ([[0, 2**32 - 1], [5, 6]], torch.int64),
                          ([0.5, 1e-300], torch.float32), ([True, False], torch.bool)):
        got = host_values(values, dtype, "cpu")
        assert got.dtype == dtype and got.device.type == "cpu" and torch.equal(got, torch.tensor(values, dtype=dtype))
    assert host_values([], torch.long).shape == (0,) and host_values([7], torch.long).device.type == "cpu"
    meta = host_values([1, 2], torch.long, "meta")  # another device: a non-blocking copy, nothing pinned
    assert meta.device.type == "meta" and meta.shape == (2,) and meta.dtype == torch.long


def test_on_cuda_the_values_go_through_pinned_memory_without_blocking(monkeypatch):
    """The CUDA branch (no CUDA here: torch's two calls recorded): pinned first, then a non-blocking copy."""
    calls = []

    def pin_memory(self):
        calls.append("pin")
        return self

    def to(self, device, non_blocking=False):
        calls.append(("to", torch.device(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    got = host_values([4, 5], torch.long, "cuda:0")
    monkeypatch.undo()
    assert calls == ["pin", ("to", torch.device("cuda:0"), True)] and got.tolist() == [4, 5]


def test_on_cuda_a_readback_is_a_non_blocking_copy_into_pinned_memory_then_an_event(monkeypatch):
    """Readback's CUDA branch (no CUDA here: torch's calls recorded): pinned memory, a non-blocking copy and an event
    when it is made; the read waits for that event, then reads the pinned copy. On a CPU the values themselves."""
    calls, values = [], torch.tensor([[3, 4], [5, 6]])
    real_empty, real_copy = torch.empty, torch.Tensor.copy_

    class OnCuda:  # the values as a CUDA tensor
        device, shape, dtype = torch.device("cuda", 1), values.shape, values.dtype

    class Event:
        def record(self, stream=None):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append("synchronize")

    def empty(shape, dtype, pin_memory=False):
        calls.append(("empty", pin_memory))
        return real_empty(shape, dtype=dtype)

    def copy_(self, src, non_blocking=False):
        calls.append(("copy", non_blocking))
        return real_copy(self, values)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"the current stream of {device}")
    sent = Readback(OnCuda())  # the event on the stream of the values' device (a model on cuda:N), not cuda:0's
    assert calls == [("empty", True), ("copy", True), ("record", "the current stream of cuda:1")]
    sent.wait()  # waits for the event, reading nothing
    assert calls[3:] == ["synchronize"]
    values.add_(10)  # what is read is the copy made when it was sent
    assert sent.tolist() == [[3, 4], [5, 6]] and calls[4:] == ["synchronize"]
    monkeypatch.undo()
    assert Readback(values).tolist() == values.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: bench/gpu_check.py's kernels "
                                                          "section runs it")
def test_on_cuda_a_readback_waits_for_its_own_work_and_not_for_what_was_queued_after():
    """Values sent ahead are waited for and read while kernels queued after them (``torch.cuda._sleep``) still run; a
    plain read of the same values waits for those kernels."""
    stream = torch.cuda.current_stream()
    values = torch.arange(6, device="cuda").reshape(2, 3) * 2
    sent = Readback(values)
    torch.cuda._sleep(500_000_000)
    sent.wait()  # so does a wait for them
    assert not stream.query()
    assert sent.tolist() == [[0, 2, 4], [6, 8, 10]] and not stream.query()
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)
    assert values.tolist() == [[0, 2, 4], [6, 8, 10]] and stream.query()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: bench/gpu_check.py's kernels "
                                                          "section runs it")
def test_on_cuda_neither_host_values_nor_a_ragged_caches_step_waits_for_queued_kernels():
    """Kernels queued for a while (``torch.cuda._sleep``): host values, and a ragged KV cache's write, visibility
    and offsets (what every layer of a continuous-batching step computes from its rows' host lengths), return with
    the stream still busy; a plain ``torch.tensor(..., device="cuda")`` waits for it (the contrast: the check can
    fail)."""
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # some 0.3 s of device time
    got = host_values([3, 1, 2], torch.long, "cuda")
    cache = KVCache(2, 8, 1, 4, device="cuda")
    cache.lengths = [1, 3]
    cache.write_rows(torch.ones(2, 1, 1, 4, device="cuda"), torch.ones(2, 1, 1, 4, device="cuda"))
    mask, offset = visible_keys(cache.lengths, 1, True, torch.device("cuda")), cache.offset()
    busy = not stream.query()
    torch.cuda.synchronize()
    assert busy and got.tolist() == [3, 1, 2] and offset[:, 0].tolist() == [2, 4] and mask.shape == (2, 1, 5)
    torch.cuda._sleep(500_000_000)
    torch.tensor([3, 1, 2], device="cuda")
    assert stream.query()  # it waited


# ---------------------------------------------------------------------------------------------- whole steps
# Every decoding step of continuous batching, audited on this CPU for what would make the host wait for a CUDA
# device (tests/device_waits.py): the step's passes, draws and cache bookkeeping must queue without a wait, and read
# back only what the host needs: base decoding its tokens, once per step (or per round's several steps), speculative
# decoding its acceptance, once per step.

def tiny(kind: str = "full", depth: int = 2, seed: int = 0, device: str = "cpu"):
    """The continuous-batching tests' tiny model (small blocks, so that short rows cross several), on ``device``."""
    return lm(seed, depth, kind).to(device)


def jobs(gamma: int | None = None) -> list[Job]:
    """Ragged rows of every sampling kind (greedy, top-k, nucleus)."""
    return [Job([1, 2, 3, 4, 5], 12, HOT, seed=1, gamma=gamma), Job([4, 5], 12, NUCLEUS, seed=2, gamma=gamma),
            Job([7], 12, GREEDY, seed=3, gamma=gamma)]


def compiled_on_device(monkeypatch, compile: str) -> None:
    """Compiled passes run their traced function eagerly, unaudited: on a GPU it is a graph's replay (no host code)."""
    if compile == "on":
        monkeypatch.setattr(compiled, "compiled_function", lambda fn, device_type: on_device(fn))


def since(audit: DeviceWaits, fn, *args) -> tuple[object, list[str]]:
    """``fn(*args)``'s result and the waits it added to ``audit``'s (what each would wait for)."""
    n = len(audit.waits)
    out = fn(*args)
    return out, audit.waits[n:]


@pytest.mark.parametrize("kind, compile", [("full", "off"), ("performer", "off"), ("sinkhorn", "off"),
                                           ("nsa", "off"), ("full", "on")])
def test_a_base_step_reads_the_device_once_for_its_tokens_and_queues_everything_else(kind, compile, monkeypatch,
                                                                                      one_thread):
    """The engine audited from its start (its caches made under the audit: those on the host are known)."""
    compiled_on_device(monkeypatch, compile)
    model, running = tiny(kind), jobs()
    with torch.no_grad(), DeviceWaits() as audit:
        engine = BaseEngine(model, compile=compile)
        _, waits = since(audit, engine.admit, running)  # the prefill, its first tokens read back
        assert [w for w, _ in waits] == ["reads a device value (tolist)"], waits
        for steps in (1, 3):  # one step, and a round's several: the tokens read back once, after the last
            before = [len(j.out) for j in running]
            ran, waits = since(audit, engine.step, "all", steps)
            assert ran == steps and [len(j.out) - n for j, n in zip(running, before)] == [steps] * 3
            assert [w for w, _ in waits] == ["reads a device value (tolist)"], waits
            assert waits[0][1].endswith("(commit)")  # the commit's, not one inside the passes


@pytest.mark.parametrize("compile", ["off", "on"])
@pytest.mark.parametrize("same_draft", [False, True], ids=["draft", "draft=target"])
def test_a_speculative_step_reads_the_device_once_for_its_acceptance(compile, same_draft, monkeypatch, one_thread):
    """With the target as its own draft every row keeps every draft: the next step's first draft pass feeds each
    row's last draft beside its pending token (built from the host's tokens, not read back)."""
    compiled_on_device(monkeypatch, compile)
    target = tiny()
    draft, running = target if same_draft else tiny(depth=1, seed=1), jobs(gamma=3)
    with torch.no_grad(), DeviceWaits() as audit:
        engine = SpeculativeEngine(target, draft, 3, compile=compile)
        _, waits = since(audit, engine.admit, running)
        assert waits == [], waits  # speculative prefills draw nothing: no read at all
        for _ in range(3):
            _, waits = since(audit, engine.step, "all")
            assert [w for w, _ in waits] == ["reads a device value (tolist)"], waits
            assert waits[0][1].endswith("(_step)")  # after the verify pass: the acceptance
    if same_draft:
        assert all(j.draft_tail is not None for j in running) and all(a == 3 for j in running
                                                                      for a in j.stats.accepted)


@pytest.mark.parametrize("compile, chunk, pipeline", [("off", 0, False), ("on", 0, False), ("off", 4, False),
                                                      ("off", 0, True), ("on", 0, True)])
def test_a_schedulers_rounds_read_the_device_only_for_its_tokens_and_acceptance(compile, chunk, pipeline, monkeypatch,
                                                                                 one_thread):
    """Whole rounds (arrivals, prefills, several steps a round, rows leaving, base and speculative batches; prompts
    prefilled in chunks of ``chunk`` tokens; base steps pipelined or not): each base pass (a prefill, or a round's
    steps) reads its tokens once (a pipelined step where it is settled), each speculative step its acceptance once,
    and nothing else reads or waits (a prefill's chunks read nothing), but a pipelined base prefill's wait for the
    step in flight it was queued behind (that step's tokens sent ahead; its cost is the step's, not the prefill's)."""
    compiled_on_device(monkeypatch, compile)
    computes = {"base": [], "speculative": []}  # the steps each compute ran
    for engine in (BaseEngine, SpeculativeEngine):
        def compute(self, state, real=engine.compute):
            out = real(self, state)
            computes[self.kind].append(state.steps)
            return out

        monkeypatch.setattr(engine, "compute", compute)
    target, draft = tiny(), tiny(depth=1, seed=1)
    plan = [(0, [1, 2, 3], 12, HOT, None), (0, [4, 5], 20, NUCLEUS, 3), (1, [7], 6, GREEDY, None),
            (3, [7, 8], 16, GREEDY, 2), (4, [9] * 9, 9, HOT, None)]
    with torch.no_grad(), DeviceWaits() as audit:
        scheduler = Scheduler(target, draft, compile=compile, steps_per_round=2, short_tokens=0,  # all rows step
                              prefill_chunk=chunk, pipeline=pipeline)
        r = 0
        while r < 5 or scheduler.running or scheduler._queue:
            for at, prompt, n, sampling, gamma in plan:
                if at == r:
                    scheduler.submit(Job(prompt, n, sampling, seed=r, gamma=gamma))
            scheduler.run_once()
            r += 1
    where = [(w, at.split(" ")[-1]) for w, at in audit.waits]
    read = "reads a device value (tolist)"
    # a pipelined step's tokens: sent to the host when it is queued, read when it is settled
    ahead = "reads a value sent ahead (tolist)"
    steps_read = (ahead, "(_read)") if pipeline else (read, "(commit)")
    # pipelined: a prefill queued behind the step in flight waits for that step, then for itself (reading its token)
    behind = ("waits for a value sent ahead (wait)", "(_await)")
    assert set(where) - {behind} == {(read, "(commit)"), steps_read, (read, "(_step)")}, audit.waits
    assert (behind in where) == pipeline
    chunks = 2 if chunk else 0  # the 9-token prompt's first two chunks of 4 (its last joins as a prefill)
    prefills = scheduler.costs["base"].prefill_passes - chunks
    assert where.count((read, "(commit)")) + where.count((ahead, "(_read)")) == prefills + len(computes["base"])
    assert where.count((ahead, "(_read)")) == len(audit.ahead) == (len(computes["base"]) if pipeline else 0)
    if pipeline:  # every step that followed one in flight was queued before that one was read, and not waited for
        followed = scheduler.pipelining()["followed"]
        assert followed > 0 and sum(n > 0 for n in audit.ahead) >= followed, (audit.ahead, followed)
    assert where.count((read, "(_step)")) == sum(computes["speculative"])  # a speculative prefill reads nothing
    assert max(computes["base"]) == max(computes["speculative"]) == 2  # several steps a round ran, in both modes


@pytest.mark.parametrize("compile", ["off", "on"])
def test_the_librarys_decoding_loops_read_the_device_once_a_speculative_step_and_never_a_base_step(compile,
                                                                                                  monkeypatch,
                                                                                                  one_thread):
    compiled_on_device(monkeypatch, compile)
    target, draft = tiny(), tiny(depth=1, seed=1)
    prompts, sampling = [[1, 2, 3], [4, 5]], {"temperature": 1.0, "top_k": 20, "seed": 1}
    with torch.no_grad(), DeviceWaits() as audit:
        tokens = list(iter_generate(target, prompts, 10, compile=compile, **sampling))  # (B,) device tensors
        assert audit.waits == [] and len(tokens) == 10
        steps = list(iter_speculative_rows(target, draft, [[1, 2, 3], [4, 5, 6, 7]], [10, 4], gamma=3,
                                           compile=compile, **sampling))
    assert [w for w, _ in audit.waits] == ["reads a device value (tolist)"] * len(steps), audit.waits
    assert all(where.endswith("(_steps)") for _, where in audit.waits)


def test_the_audit_finds_every_kind_of_wait():
    """tests/device_waits.py finds what would wait on a GPU, and only that (else the tests above prove nothing)."""
    computed = torch.arange(4) * 2  # made before the audit: taken for a device tensor (the model's weights are)
    with DeviceWaits() as mode:
        host = torch.tensor([1, 2])  # built from host values
        host = (torch.full((2,), 3) + host)[host > 0]  # ... or computed from host tensors only: on the host
        (torch.ones(2, device="cpu") + host).tolist()  # made on the device, so computed there
        computed.tolist()
        int(computed[0])
        bool(computed[1])
        computed[computed > 2]  # a boolean mask as an index: sized by device values
        computed.nonzero()
        torch.tensor([1, 2], device="cpu")
        host.to("cpu", non_blocking=True)
        computed.copy_(torch.tensor([0, 1, 2, 3]))
        host.tolist()  # free: already on the host
        host.to(torch.float32)  # a dtype, not a device
        values = host_values([5, 6], torch.long, "cpu")  # the way without a wait ...
        on_device(lambda: computed.sum().item())()  # ... and a compiled graph's inside
        values.tolist()  # ... but host values made device tensors are device tensors
        sent = Readback(computed * 3)  # sent ahead: its read waits for the work queued before it only
        computed + 1
        on_device(lambda: computed * 2)()
        assert sent.tolist() == [0, 3, 6, 9]
    assert [w for w, _ in mode.waits] == [
        "reads a device value (tolist)", "reads a device value (tolist)", "reads a device value (__int__)",
        "reads a device value (__bool__)",
        "__getitem__: a result sized by device values", "nonzero: a result sized by device values",
        "torch.tensor(..., device=...)", "a host tensor's .to(device)", "device.copy_(host tensor)",
        "reads a device value (tolist)", "reads a value sent ahead (tolist)"], mode.waits
    assert mode.ahead == [2]  # the addition and the compiled graph, queued after it was sent
    assert all(where.startswith("tests/test_host.py:") and where.endswith("(test_the_audit_finds_every_kind_of_wait)")
               for _, where in mode.waits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: bench/gpu_check.py's kernels "
                                                          "section runs it")
@pytest.mark.parametrize("compile", ["off", "on"])
def test_on_cuda_a_rounds_base_steps_queue_without_waiting_until_their_tokens_are_read(compile):
    """Continuous batching's base steps on a GPU, eager and compiled (CUDA graphs): with some 0.3 s of device work
    queued before them, a round's two steps (their passes, draws and cache bookkeeping) are all queued while the
    stream is still busy; only then are the tokens read. Compiled, the graphs are recorded by earlier steps."""
    stream = torch.cuda.current_stream()
    engine, running = BaseEngine(tiny(device="cuda"), compile=compile), jobs()
    busy = []
    real = engine.compute

    def compute(state):
        out = real(state)
        busy.append(not stream.query())  # before anything reads the tokens back
        return out

    with torch.no_grad():
        engine.admit(running)
        for _ in range(3):
            engine.step("all")
        engine.compute = compute
        torch.cuda.synchronize()
        torch.cuda._sleep(500_000_000)
        assert engine.step("all", 2) == 2
    assert busy == [True] and all(len(j.out) == 6 for j in running)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: bench/gpu_check.py's kernels "
                                                          "section runs it")
@pytest.mark.parametrize("compile", ["off", "on"])
def test_on_cuda_a_pipelined_round_returns_with_its_step_still_queued(compile):
    """Pipelined base steps on a GPU (the scheduler's default there), eager and compiled: with some 0.3 s of device
    work queued before a round, the round queues its step behind it, reads the step before (finished already) and
    returns while the stream is still busy; unpipelined, the round waits for its own step's tokens. Both give every
    request the same tokens."""
    stream = torch.cuda.current_stream()
    target, outs = tiny(device="cuda"), []
    for pipeline in (True, False):
        scheduler = Scheduler(target, compile=compile, short_tokens=0, pipeline=None if pipeline else False)
        assert scheduler.pipeline is pipeline
        running = [scheduler.submit(j) for j in jobs()]
        with torch.no_grad():
            for _ in range(4):  # the prefill and steps (compiled: the graphs recorded)
                scheduler.run_once()
            torch.cuda.synchronize()
            torch.cuda._sleep(500_000_000)
            scheduler.run_once()
            assert (not stream.query()) is pipeline
            scheduler.drain()
        outs.append([j.out for j in running])
    assert outs[0] == outs[1] and all(len(out) == 12 for out in outs[0])
