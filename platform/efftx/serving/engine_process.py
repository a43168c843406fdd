"""Continuous batching in a decoding process of its own: the text app's ``engine="process"``.

**Why.** With ``engine="thread"`` (the default) the :class:`~efftx.serving.continuous.Scheduler` runs on a thread
of the replica, beside Serve's request path, FastAPI, pydantic and the streams' events, all under one interpreter
lock: torch's kernels release it, but each of a step's few hundred operations takes it back, and waits for it
while the request handling holds it. Over HTTP, with 16 clients on a 2-core CPU, the decoding thread never waited
for work (py-spy: every sample of it inside a round) yet ran only 62% of a core. In a process of its own the same
load served 1.02-1.15x the requests/s for base decoding and 1.11-1.23x for speculative decoding
(``bench/serve_load.py``'s ``process`` configuration, paired round by round with ``continuous``; two runs of three
rounds). On that machine the decoding process, too, ran only about two thirds of a core: the Serve proxy, the
replica's request handling and the clients share the two cores with it (CPU pressure 42%).

**How.** :class:`EngineProcess` starts a child process (multiprocessing, ``spawn``) that loads the exports itself,
warms up and runs the scheduler (:func:`~efftx.serving.continuous.start_scheduler`: the code the thread runs, so the
same rounds and the same tokens) with an interpreter of its own. In the replica the :class:`EngineProcess` stands
where the scheduler would (``submit``, ``cancel``, ``latch``, ``report``): a submitted
:class:`~efftx.serving.continuous.Job` goes to the child as its settings; the child sends back, batched into one
message per wake-up of its sender, each step's tokens (and acceptance) per row, each pass's row count (the replica's
metrics), and when a row ends its statistics, failure or cancellation. A reader thread of the replica hands them to
the job as the scheduler would (``on_step``, then ``on_done``, the app's callbacks). Only a row with an ``on_step``
(a stream) has its steps sent as they happen; any other row's tokens and first-token time come with its end
(a step's tokens per row are most of the messages: with 16 rows, a few thousand a second on a CPU, each pickled by
the child's sender thread and read by the replica's reader, both beside a busy thread). A streamed row's
first-token time is the replica's, when it received the token; another row's is the child's (``perf_counter``,
the system's monotonic clock, the same in both processes); finish times are the replica's.

**Faults.** A request's failure is the one it gets in the thread (contained passes, 422 / 503 / 500). A device fault
in the child fails its rows as in the thread, and the child tells the replica, whose health check then fails. Should
the child exit (killed, out of host memory, a crash in native code), every running and queued request fails with a
503 (:class:`~efftx.generation.faults.DeviceFault`), later ones at once, and the replica's health check fails, so
Serve replaces the replica. The child exits when the replica does (its pipe closes). A child that cannot start (its
warm-up fails, say) fails the replica's constructor with the child's error.

Hooks (``Scheduler(hook=...)``, which tests use to inject faults) run only with the thread: they are the replica's
code."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import threading
import time
import traceback
from typing import Any, Callable

from efftx.generation.faults import DeviceFault
from efftx.serving.batches import Job, Sampling, _call
from efftx.serving.faults import FaultLatch

__all__ = ["ENGINES", "EngineProcess", "EngineProcessError", "START_TIMEOUT_S"]

ENGINES = ("thread", "process")  # where the text app's continuous batching decodes (its ``engine``)

logger = logging.getLogger("ray.serve")

START_TIMEOUT_S = 900.0  # loading the exports and warming up (compiled graphs take minutes on a CPU)
REPORT_TIMEOUT_S = 10.0


class EngineProcessError(RuntimeError):
    """The decoding process could not start (its error, from the child)."""


def _portable(exc: BaseException) -> BaseException:
    """``exc`` where it survives pickling, else a RuntimeError with its type and text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type: what matters is its text
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------- the child
class _Child:
    """The decoding process: the models, the scheduler, and the pipe to the replica."""

    def __init__(self, conn, spec: dict[str, Any]):
        import torch

        from efftx.export import load_export
        from efftx.kernels.linear_cpu import use_weights
        from efftx.serving.continuous import start_scheduler
        from efftx.serving.devices import cache_budget
        from efftx.serving.playground import linear_weights

        self.conn = conn
        self.outbox: list[tuple] = []
        self.cv = threading.Condition()
        self.jobs: dict[int, Job] = {}
        torch.set_num_threads(int(spec["threads"]))  # the scheduler's thread takes it from here
        device = torch.device(spec["device"])
        models = [load_export(path, device)[0] if path else None for path in (spec["target"], spec["draft"])]
        for model in models:
            if model is not None:
                use_weights(model, spec["weights"])
        warm, knobs = spec["warm"], spec["knobs"]
        if spec.get("cache"):  # the caches' budget, worked out here, on the device (its memory read in this process)
            budget = cache_budget(spec["cache"]["cache_mib"], spec["cache"]["cache_fraction"], device,
                                  spec["cache"]["gpu_share"])
            warm, knobs = {**warm, "cache_budget": budget}, {**knobs, "cache_budget": budget}
        self.scheduler, info = start_scheduler(*models, warm=warm, knobs=knobs,
                                               observe=lambda kind, rows: self.put(("batch", kind, rows)))
        info["linear_weights"] = [linear_weights(m) for m in models if m is not None]  # the replica's model cards
        threading.Thread(target=self._send, name="efftx-decoding-sender", daemon=True).start()
        self.put(("ready", info))

    def put(self, item: tuple) -> None:
        with self.cv:
            self.outbox.append(item)
            self.cv.notify()

    def _send(self) -> None:
        """Everything put since the last send, in one message (a step's rows together)."""
        while True:
            with self.cv:
                while not self.outbox:
                    self.cv.wait()
                items, self.outbox = self.outbox, []
            try:
                self.conn.send(items)
            except (OSError, ValueError):  # the replica is gone
                return

    def _submit(self, key: int, prompt: list[int], max_new: int, sampling: tuple, seed, gamma, max_gamma,
                coupled: bool, stream: bool) -> None:
        on_step = (lambda tokens, accepted: self.put(("step", key, tokens, accepted))) if stream else None
        job = Job(prompt, max_new, Sampling(*sampling), seed, gamma, max_gamma=max_gamma, coupled=coupled,
                  on_step=on_step, on_done=lambda j: self._done(key, j, stream))
        self.jobs[key] = job
        try:
            self.scheduler.submit(job)
        except Exception as exc:  # noqa: BLE001 - a request the scheduler refuses fails alone
            job._fail(exc, f"{job.mode} decoding")

    def _done(self, key: int, job: Job, stream: bool) -> None:
        self.jobs.pop(key, None)
        fault = self.scheduler.fault
        self.put(("done", key, {
            "out": None if stream else job.out, "first_token": None if stream else job.first_token,
            "steps": job.steps, "batch_size": job.batch_size, "stats": job.stats, "cancelled": job.cancelled,
            "error": None if job.error is None else _portable(job.error),
            "failure": None if job.failure is None else job.failure.model_dump(),
            "fault": None if fault is None else str(fault)}))

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the replica is gone
                break
            kind = message[0]
            if kind == "submit":
                self._submit(*message[1:])
            elif kind == "cancel":
                job = self.jobs.get(message[1])
                if job is not None:
                    self.scheduler.cancel(job)
            elif kind == "report":
                self.put(("report", message[1], self.scheduler.report()))
            elif kind == "close":
                break
        self.scheduler.close()


def _child_main(conn, spec: dict[str, Any]) -> None:
    try:
        child = _Child(conn, spec)
    except BaseException:  # noqa: BLE001 - the replica raises it, with the child's traceback
        conn.send([("failed", traceback.format_exc())])
        return
    child.serve()


# ---------------------------------------------------------------------------------------------- the replica's side
class EngineProcess:
    """Continuous batching in a child process (see the module docstring), with the scheduler's interface.

    ``spec``: ``target`` and ``draft`` (export folders; draft None), ``device`` (``"cpu"``, ``"cuda:0"``),
    ``weights`` (:func:`~efftx.kernels.linear_cpu.use_weights`), ``threads`` (torch's intra-op threads), ``warm``
    (:func:`~efftx.serving.continuous.warm_up`'s arguments), ``knobs`` (the
    :class:`~efftx.serving.continuous.Scheduler`'s) and optionally ``cache`` (``cache_mib``, ``cache_fraction``,
    ``gpu_share``: :func:`~efftx.serving.devices.cache_budget`'s, worked out in the child on its device, the budget
    given to both). ``observe(kind, rows)``: called, on the reader thread, for
    every pass the child runs (the replica's metrics). Blocks until the child has warmed up (``start_timeout``
    seconds at most)."""

    def __init__(self, spec: dict[str, Any], observe: Callable[[str, int], None] | None = None,
                 start_timeout: float = START_TIMEOUT_S):
        ctx = multiprocessing.get_context("spawn")  # never fork a process with threads (and maybe a GPU)
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_child_main, args=(child_conn, spec), name="efftx-decoding", daemon=True)
        self._process.start()
        child_conn.close()  # the child's end is the child's: its exit is this end's EOF
        self.observe = observe
        self.latch = FaultLatch("decoding process")
        self._lock = threading.Lock()  # the jobs, the keys and the pipe's sending end
        self._jobs: dict[int, Job] = {}
        self._keys: dict[int, int] = {}  # id(job) -> its key
        self._next = itertools.count()
        self._reports: dict[int, list] = {}  # key -> [Event, report]
        self._closing = False
        self.info = self._started(start_timeout)  # start_scheduler's report (the app's batching info)
        self._reader = threading.Thread(target=self._read, name="efftx-decoding-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def fault(self) -> DeviceFault | None:
        return self.latch.fault

    def _started(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(min(1.0, max(deadline - time.monotonic(), 0.0))):
            if not self._process.is_alive() or time.monotonic() > deadline:
                self._stop()
                raise EngineProcessError(
                    f"the decoding process exited with code {self._process.exitcode} before it was ready"
                    if self._process.exitcode is not None else
                    f"the decoding process was not ready after {timeout:.0f} s (loading and warming up)")
        try:
            items = self._conn.recv()
        except (EOFError, OSError):
            self._stop()
            raise EngineProcessError(f"the decoding process exited with code {self._process.exitcode} before it "
                                     "was ready") from None
        (kind, value), self._early = items[0], items[1:]
        if kind == "failed":
            self._stop()
            last = value.strip().splitlines()[-1] if value.strip() else "no error text"
            raise EngineProcessError(f"the decoding process failed to start: {last}\n{value}")
        return value

    # -- the scheduler's interface (any thread)
    def submit(self, job: Job) -> Job:
        job.submitted = time.perf_counter()
        if self.fault is not None:
            job._fail(self.fault, f"{job.mode} decoding")
            return job
        s = job.sampling
        with self._lock:
            key = next(self._next)
            self._jobs[key], self._keys[id(job)] = job, key
            try:
                self._conn.send(("submit", key, job.prompt, job.max_new, (s.temperature, s.top_k, s.top_p), job.seed,
                                 job.gamma, job.max_gamma, job.coupled, job.on_step is not None))
                return job
            except (OSError, ValueError):  # the child is gone: the reader fails the rest
                self._jobs.pop(key, None)
                self._keys.pop(id(job), None)
        job._fail(self._exited_fault(), f"{job.mode} decoding")
        return job

    def cancel(self, job: Job) -> None:
        """Drop ``job`` at the child's next step (its client went away)."""
        job.cancelled = True
        with self._lock:
            key = self._keys.get(id(job))
            if key is not None:
                try:
                    self._conn.send(("cancel", key))
                except (OSError, ValueError):
                    pass

    def report(self, timeout: float = REPORT_TIMEOUT_S) -> dict[str, Any]:
        """The child scheduler's :meth:`~efftx.serving.continuous.Scheduler.report` (None for each where the child
        does not answer within ``timeout`` s or is gone)."""
        empty = {"costs": None, "cache_memory": None, "scheduling": None}
        if self.fault is not None or self._closing:
            return empty
        waiter = [threading.Event(), empty]
        with self._lock:
            key = next(self._next)
            self._reports[key] = waiter
            try:
                self._conn.send(("report", key))
            except (OSError, ValueError):
                self._reports.pop(key, None)
                return empty
        waiter[0].wait(timeout)
        with self._lock:
            self._reports.pop(key, None)
        return waiter[1]

    def close(self) -> None:
        self._closing = True
        with self._lock:
            try:
                self._conn.send(("close",))
            except (OSError, ValueError):
                pass
        self._process.join(timeout=10)
        self._stop()

    def _stop(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)

    # -- the reader thread
    def _read(self) -> None:
        for item in self._early:  # sent with "ready"
            self._handle(item)
        while True:
            try:
                items = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a message that does not unpickle: the child is not to be trusted
                logger.exception("decoding process: a message from the child could not be read")
                break
            for item in items:
                try:
                    self._handle(item)
                except Exception:  # noqa: BLE001 - one row's hand-over must not stop the others'
                    logger.exception("decoding process: handing over %s failed", item[0])
        self._exited()

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "step":
            _, key, tokens, accepted = item
            job = self._jobs.get(key)
            if job is None:
                return
            if tokens and job.first_token is None:
                job.first_token = time.perf_counter()
            job.out.extend(tokens)
            if job.on_step is not None:
                _call(job.on_step, tokens, accepted)
        elif kind == "done":
            _, key, result = item
            with self._lock:
                job = self._jobs.pop(key, None)
                if job is not None:
                    self._keys.pop(id(job), None)
            if result["fault"] is not None and self.latch.fault is None:
                self.latch.fault = DeviceFault(result["fault"])
                logger.error("decoding process: %s", result["fault"])
            if job is None:
                return
            if result["out"] is not None:  # a row without a stream: its tokens come now
                job.out.extend(result["out"])
                if job.first_token is None:
                    job.first_token = result["first_token"]
            job.steps, job.batch_size, job.stats = result["steps"], result["batch_size"], result["stats"]
            job.cancelled = job.cancelled or result["cancelled"]
            if result["error"] is not None:
                job.error = result["error"]
                job.failure = _row_failure(result["failure"])
            job._finish()
        elif kind == "batch":
            if self.observe is not None:
                _call(self.observe, item[1], item[2])
        elif kind == "report":
            waiter = self._reports.get(item[1])
            if waiter is not None:
                waiter[1] = item[2]
                waiter[0].set()

    def _exited_fault(self) -> DeviceFault:
        code = self._process.exitcode
        return DeviceFault(f"the decoding process exited{'' if code is None else f' with code {code}'}; this "
                           "replica takes no more requests and is replaced")

    def _exited(self) -> None:
        """The child is gone: every request it held fails with a 503, and so will every later one."""
        if self._closing:
            return
        self._process.join(timeout=5)
        fault = self._exited_fault()
        if self.latch.fault is None:
            self.latch.fault = fault
            logger.error("decoding process: %s", fault)
        with self._lock:
            jobs, self._jobs, self._keys = list(self._jobs.values()), {}, {}
            waiters, self._reports = list(self._reports.values()), {}
        for job in jobs:
            job._fail(self.latch.fault, f"{job.mode} decoding")
        for waiter in waiters:
            waiter[0].set()


def _row_failure(fields: dict | None):
    """The child's :class:`~efftx.serving.isolation.RowFailure` (None without the web stack, as in the child)."""
    if fields is None:
        return None
    try:
        from efftx.serving.isolation import RowFailure
    except ImportError:
        return None
    return RowFailure(**fields)
