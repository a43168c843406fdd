"""What a user reads on the driver: the workers' output, without the lines that say nothing to them.

Ray prints every worker's stdout/stderr on the driver (``log_to_driver``), and a training run's workers and
Ray's own actors print lines a user cannot act on: DeepSpeed's "DeepSpeed deepspeed.ops.comm..._op built
successfully" (a bare ``print`` on every worker at every engine start) and Ray Train's controller's
error-level "Actor with class name: 'PreemptionWatcher' ... max_restarts > 0" (Ray's own actor; see
ray-project/ray#53727); that actor also warns "PreemptionWatcher poll failed" with a traceback when one of its
polls of the GCS fails (seen in CI on a busy machine as a run's cluster shut down, after the run's summary; Ray
polls again). :func:`filter_worker_logs` wraps the driver's handler of those lines so that exactly the lines
matching :data:`NOISE`, and that warning of Ray Train's PreemptionWatcher actor with its traceback
(:class:`PollFailures`), are dropped; everything else is printed as Ray prints it.

On a terminal (the driver's stdout is a TTY, or ``EFFTX_PROGRESS=bar``) the training loop's step lines
("[efftx] step N/M loss ... eta ...") are drawn as one progress bar that redraws in place (:class:`Progress`):
steps, loss, tokens/s and the time left. Anywhere else (``ray job submit`` logs, CI, a pipe, or
``EFFTX_PROGRESS=lines``) they stay plain lines, one per ``train.log_every`` steps, with the same ETA.

The hook is Ray's private ``global_worker_stdstream_dispatcher`` (Ray 2.60, pinned): if a Ray version lacks
it, nothing is filtered and nothing breaks.
"""

from __future__ import annotations

import os
import re
import sys
import threading

NOISE = (
    re.compile(r"^DeepSpeed deepspeed\.ops\.\S+ built successfully$"),
    re.compile(r"Actor with class name: 'PreemptionWatcher' .* has constructor arguments in the object store "
               r"and max_restarts > 0"),
)
_HANDLER = "ray_print_logs"  # the name Ray's driver gives its handler
STEP = re.compile(r"\[efftx\] step (\d+)/(\d+) loss (\S+) lr \S+ tok/s (\S+) .*\beta (\S+)$")


def is_noise(line: str) -> bool:
    text = line.strip()
    return any(p.search(text) for p in NOISE)


WATCHER_ACTOR = "PreemptionWatcher"  # Ray Train's actor (its log lines come with this actor name)
POLL_FAILED = re.compile(r"\bPreemptionWatcher poll failed$")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Timeout)\b")


class PollFailures:
    """Drops Ray Train's PreemptionWatcher "poll failed" warnings and their tracebacks (chained ones included)
    from worker output batches (:func:`filter_worker_logs`' data dicts), following a traceback across batches per
    process. Only lines of that actor are touched, and of them only that warning and the traceback after it."""

    # lines that begin a traceback, or the next one of a chain
    STARTS = ("Traceback (", "During handling of the above exception", "The above exception was the direct cause")

    def __init__(self):
        self._state: dict = {}  # pid -> "traceback" (inside one) or "raised" (after its exception line)

    def keep(self, data: dict, lines: list[str]) -> list[str]:
        if WATCHER_ACTOR not in str(data.get("actor_name") or ""):
            return lines
        pid = data.get("pid")
        kept = []
        for line in lines:
            text = line.rstrip()
            state = self._state.get(pid)
            if POLL_FAILED.search(text):
                self._state[pid] = "traceback"
            elif state == "traceback" and (not text or text[0].isspace() or text.startswith(self.STARTS)):
                pass
            elif state == "traceback" and EXCEPTION_LINE.match(text):
                self._state[pid] = "raised"  # the end, unless a chained exception follows
            elif state == "raised" and not text:
                pass
            elif state == "raised" and text.startswith(self.STARTS):
                self._state[pid] = "traceback"
            else:
                self._state.pop(pid, None)
                kept.append(line)
        return kept


def progress_mode(stream=None) -> str:
    """'bar' or 'lines': EFFTX_PROGRESS (bar | lines | auto, the default), auto = bar on a terminal."""
    want = os.environ.get("EFFTX_PROGRESS", "auto").strip().lower()
    if want in ("bar", "lines"):
        return want
    stream = stream or sys.stdout
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):
        return "lines"


class Progress:
    """One progress bar on ``stream``, redrawn in place from the step lines; any other output first ends it."""

    WIDTH = 24

    def __init__(self, stream=None):
        self._stream, self.shown = stream, False  # None: sys.stdout as it is at each write

    @property
    def stream(self):
        return self._stream or sys.stdout

    def draw(self, line: str) -> bool:
        """Draw ``line`` as the bar if it is a step line; False (nothing drawn) otherwise."""
        m = STEP.search(line.strip())
        if not m:
            return False
        step, total, loss, tok_s, eta = int(m[1]), int(m[2]), m[3], m[4], m[5]
        filled = self.WIDTH * step // max(total, 1)
        self.stream.write(f"\r\x1b[2K[{'#' * filled}{'.' * (self.WIDTH - filled)}] step {step}/{total} "
                          f"loss {loss} tok/s {tok_s} eta {eta}")
        self.shown = step < total
        if not self.shown:
            self.stream.write("\n")  # the last step: the bar stays, finished, on its own line
        self.stream.flush()
        return True

    def end(self) -> None:
        """Move past an unfinished bar before other output is printed."""
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


def filter_worker_logs() -> bool:
    """Drop :data:`NOISE` lines from the worker output Ray prints on this driver (once per process; call after
    ``ray.init``). Returns whether the filter is installed."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        handlers = list(dispatcher.handlers)
    if any(getattr(h, "_efftx_filter", False) for _, h in handlers):
        return True
    printer = next((h for name, h in handlers if name == _HANDLER), None)
    if printer is None:  # log_to_driver=False: nothing is printed anyway
        return False

    lock = threading.Lock()
    bar = Progress() if progress_mode() == "bar" else None
    polls = PollFailures()

    def filtered(data):
        lines = [ln for ln in data.get("lines", []) if not is_noise(ln)]
        with lock:
            lines = polls.keep(data, lines)
            if bar is None:
                if lines:
                    printer({**data, "lines": lines})
                return
            chunk: list[str] = []
            for line in lines:
                if not data.get("is_err") and STEP.search(line.strip()):
                    if chunk:
                        bar.end()
                        printer({**data, "lines": chunk})
                        chunk = []
                    bar.draw(line)
                else:
                    chunk.append(line)
            if chunk:
                bar.end()
                printer({**data, "lines": chunk})

    filtered._efftx_filter = True
    dispatcher.remove_handler(_HANDLER)
    dispatcher.add_handler(_HANDLER, filtered)
    return True
