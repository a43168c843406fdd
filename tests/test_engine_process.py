"""Continuous batching in a decoding process of its own (efftx.serving.engine_process), without Ray: a request's
tokens, stream and acceptance are those the scheduler gives it on a thread; a cancelled request leaves; a request
the process refuses fails alone; a process that exits fails its requests with a 503 and makes the replica unhealthy;
a process that cannot start fails with its error. Over HTTP the text app's tests run against both engines
(tests/test_serve.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from efftx.export import load_export
from efftx.generation.faults import DeviceFault
from efftx.serving.continuous import Job, Sampling, start_scheduler
from efftx.serving.engine_process import EngineProcess, EngineProcessError

pytestmark = pytest.mark.usefixtures("one_thread")

WARM = {"rows": 2, "gamma": 3, "coupled": True}
KNOBS = {"max_rows": 8}


def spec(paths: dict, draft: bool = True, **over) -> dict:
    return {"target": paths["target"], "draft": paths["draft"] if draft else None, "device": "cpu",
            "weights": "float32", "threads": 1, "warm": WARM, "knobs": KNOBS, **over}


@pytest.fixture(scope="module")
def engine(debug_exports):
    passes: list[tuple[str, int]] = []
    ep = EngineProcess(spec(debug_exports), observe=lambda kind, rows: passes.append((kind, rows)))
    ep.passes = passes
    yield ep
    ep.close()


def finished(engine, jobs: list[Job], timeout: float = 120.0) -> list[Job]:
    """Submit ``jobs`` together and wait until each has its ``on_done``."""
    done = [threading.Event() for _ in jobs]
    for job, event in zip(jobs, done):
        job.on_done = lambda j, e=event: e.set()
    for job in jobs:
        engine.submit(job)
    for job, event in zip(jobs, done):
        assert event.wait(timeout), f"no result for {job.mode} job {job.prompt}"
    return jobs


def mixed_jobs() -> list[Job]:
    """Base, speculative, adaptive and coupled requests, greedy and sampled; every other one streams its steps."""
    settings = [(None, None, False, Sampling(0.0)), (None, None, False, Sampling(0.9, 16)),
                (3, None, False, Sampling(0.0)), (3, None, False, Sampling(1.0, 0, 0.9)),
                (3, 6, False, Sampling(0.8, 8)), (3, None, True, Sampling(0.8, 8)), (None, None, False, Sampling(1.2))]
    jobs = []
    for i, (gamma, cap, coupled, sampling) in enumerate(settings):
        steps: list = []
        stream = i % 2 == 0
        job = Job([3 + i, 40 + 5 * i, 9, 1 + i][: 2 + i % 3], 6 + 3 * i, sampling, 100 + i, gamma, max_gamma=cap,
                  coupled=coupled, on_step=(lambda tokens, accepted, s=steps: s.append((list(tokens), accepted)))
                  if stream else None)
        job.streamed = steps if stream else None
        jobs.append(job)
    return jobs


def test_every_request_gets_the_tokens_stream_and_acceptance_the_thread_gives_it(engine, debug_exports, monkeypatch):
    stepped: list[int] = []  # the keys of the step messages the replica read
    handle = engine._handle

    def counting(item):
        if item[0] == "step":
            stepped.append(item[1])
        handle(item)

    monkeypatch.setattr(engine, "_handle", counting)
    remote = finished(engine, mixed_jobs())
    assert not engine._jobs  # every job ended
    target, draft = (load_export(debug_exports[role])[0] for role in ("target", "draft"))
    scheduler, _ = start_scheduler(target, draft, warm=WARM, knobs=KNOBS)
    try:
        local = finished(scheduler, mixed_jobs())
    finally:
        scheduler.close()
    for a, b in zip(remote, local):
        assert a.error is None and a.failure is None and not a.cancelled
        assert a.out == b.out and len(a.out) == a.max_new
        if a.streamed is not None:
            assert [t for tokens, _ in a.streamed for t in tokens] == a.out  # the stream carries every token, in order
            assert [acc for _, acc in a.streamed] == [acc for _, acc in b.streamed] or a.coupled
        if a.speculative and not a.coupled:  # coupled draft lengths follow measured costs: its tokens are base's
            assert a.stats.accepted == b.stats.accepted and a.stats.draft_calls == b.stats.draft_calls
        assert a.first_token is not None and a.finished >= a.first_token >= a.submitted
        assert a.batch_size >= 1 and a.steps == b.steps or a.coupled
    # only the streams' steps crossed the pipe one by one: a row without a stream got its tokens with its end
    streams = sum(job.streamed is not None for job in remote)
    assert 0 < streams < len(remote) and len(set(stepped)) == streams
    assert len(stepped) == sum(len(job.streamed) for job in remote if job.streamed is not None)
    kinds = {kind for kind, _ in engine.passes}
    assert {"base", "speculative"} <= kinds  # every pass the process ran reached the replica's metrics
    report = engine.report()
    assert set(report) == {"costs", "cache_memory", "scheduling"}
    assert "base" in report["costs"] and report["scheduling"]["rounds"] > 0


def test_a_cancelled_request_leaves_and_the_next_one_decodes(engine):
    job = Job([5, 6, 7], 100, Sampling(0.0), 1)
    job.on_step = lambda tokens, accepted: engine.cancel(job)  # the client goes away after the first step
    (job,) = finished(engine, [job])
    assert job.cancelled and job.error is None and 1 <= len(job.out) < 100
    (after,) = finished(engine, [Job([5, 6, 7], 8, Sampling(0.0), 1)])
    assert len(after.out) == 8 and not after.cancelled


def test_a_request_the_process_refuses_fails_alone_and_its_cache_budget_holds(debug_exports):
    # and a cache budget the process works out itself (its device's memory is read there)
    ep = EngineProcess(spec(debug_exports, draft=False, warm={"rows": 1},
                            cache={"cache_mib": 0.5, "cache_fraction": None, "gpu_share": None}))
    try:
        spec_job, base_job = finished(ep, [Job([5, 6], 8, Sampling(0.0), 1, 3), Job([5, 6], 8, Sampling(0.0), 1)])
        assert ep.report()["cache_memory"]["limit_mib"] == 0.5
    finally:
        ep.close()
    assert spec_job.failure.status == 422 and "draft model" in str(spec_job.failure.detail)
    assert isinstance(spec_job.error, ValueError)
    assert base_job.error is None and len(base_job.out) == 8


def test_a_process_that_exits_fails_its_requests_with_503_and_the_replica_turns_unhealthy(debug_exports):
    ep = EngineProcess(spec(debug_exports, warm={"rows": 1}))
    try:
        killed = threading.Event()

        def kill(tokens, accepted):
            if not killed.is_set():
                killed.set()
                os.kill(ep.pid, signal.SIGKILL)

        running = Job([5, 6, 7], 120, Sampling(0.0), 1, on_step=kill)
        (running,) = finished(ep, [running])
        assert killed.is_set() and len(running.out) < 120
        assert running.failure.status == 503 and isinstance(running.error, DeviceFault)
        assert "decoding process exited" in str(running.error)
        with pytest.raises(RuntimeError, match="unhealthy: the decoding process exited"):
            ep.latch.check_health()
        (later,) = finished(ep, [Job([5], 4, Sampling(0.0), 1)], timeout=5)  # fails at once
        assert later.failure.status == 503 and later.out == []
        assert ep.report() == {"costs": None, "cache_memory": None, "scheduling": None}
    finally:
        ep.close()


def test_a_process_that_cannot_start_fails_with_its_error(debug_exports):
    with pytest.raises(EngineProcessError, match="failed to start: ValueError: warm-up rows must be an integer >= 0"):
        EngineProcess(spec(debug_exports, warm={"rows": -1}))
    with pytest.raises(EngineProcessError, match="cannot read|No such file|not an export|failed to start"):
        EngineProcess(spec({"target": "/nowhere/target", "draft": None}))
    assert torch.get_num_threads() == 1  # nothing of the child leaked into this process


def test_the_replica_of_a_process_engine_reads_no_weights_and_cards_what_the_process_holds(debug_exports,
                                                                                             monkeypatch):
    """engine=process: the replica builds its models on the meta device (request checks, model cards); only the
    decoding process reads the weights."""
    from efftx import weights
    from efftx.serving.text import TextGenerator

    def refuse(*args, **kwargs):
        raise AssertionError("the replica read weights")

    monkeypatch.setattr(weights, "load", refuse)  # the replica's process only: the child is spawned fresh
    cls = TextGenerator.func_or_class.__bases__[0]  # the app's own class, under Serve's ingress wrapper
    replica = cls(debug_exports["target"], debug_exports["draft"], name="tiny", warm_up_rows=1, engine="process")
    try:
        assert all(p.device.type == "meta" for p in replica.target.parameters())
        assert [(c.role, c.device, c.details["linear_weights"]) for c in replica.model_cards] == [
            ("target", "cpu", "float32"), ("draft", "cpu", "float32")]
        assert replica.batching["engine"] == "process" and "linear_weights" not in replica.batching
        (job,) = finished(replica.scheduler, [Job([5, 6, 7], 6, Sampling(0.0), 1, 3)])
        assert job.error is None and len(job.out) == 6
    finally:
        replica.scheduler.close()


def test_the_process_exits_when_its_replica_dies(debug_exports, tmp_path):
    """A replica killed outright (no clean-up runs) leaves no decoding process behind: the child reads the end of
    its pipe and exits."""
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "replica.py"
    script.write_text("import sys, time\n"
                      "from efftx.serving.engine_process import EngineProcess\n"
                      "if __name__ == '__main__':\n"
                      f"    engine = EngineProcess({spec(debug_exports, warm={'rows': 1})!r})\n"
                      "    print(engine.pid, flush=True)\n"
                      "    time.sleep(600)\n")
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child = psutil.Process(int(replica.stdout.readline()))
        assert child.is_running() and child.ppid() == replica.pid
        replica.kill()
        replica.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        else:
            child.kill()
            pytest.fail("the decoding process outlived its replica by 30 s")
    finally:
        replica.kill()
