"""The driver prints the workers' output without the lines a user cannot act on (efftx/console.py)."""

from __future__ import annotations

import time
import uuid

import pytest

from efftx.console import is_noise

BUILT = "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"
WATCHER = ("[2026-11-23 21:46:18,671 E 7274 7337] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' "
           "and ID: '{id}' has constructor arguments in the object store and max_restarts > 0. If the arguments in "
           "the object store go out of scope or are lost, the actor restart will fail. See "
           "https://github.com/ray-project/ray/issues/53727 for more details.")


@pytest.mark.parametrize("line, noise", [
    (BUILT, True),
    ("DeepSpeed deepspeed.ops.adam.cpu_adam_op built successfully\n", True),
    (WATCHER.format(id="595eb658"), True),
    ("[efftx] step 10/40 loss 2.31", False),
    ("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op failed to build", False),  # a failure is news
    ("Actor with class name: 'TrainController' has constructor arguments in the object store and max_restarts > 0",
     False),  # only Ray Train's own PreemptionWatcher is known to be harmless
])
def test_noise_is_exactly_the_known_lines(line, noise):
    assert is_noise(line) is noise


def test_the_driver_drops_only_the_noise_of_real_workers(ray_cluster, capsys):
    import ray

    from efftx.console import filter_worker_logs

    assert filter_worker_logs() and filter_worker_logs()  # idempotent: one filter, not two
    token = uuid.uuid4().hex

    @ray.remote(num_cpus=0.01)
    def talk(token):
        print(BUILT.replace("shm_comm", f"x{token}"))
        print(WATCHER.format(id=token))
        print(f"[efftx] useful line {token}", flush=True)

    ray.get(talk.remote(token))
    out, deadline = "", time.monotonic() + 30
    while f"useful line {token}" not in out and time.monotonic() < deadline:  # worker logs arrive asynchronously
        time.sleep(0.2)
        out += capsys.readouterr().out
    assert f"[efftx] useful line {token}" in out
    assert out.count(token) == 1, out  # neither noise line reached the driver's output


def test_the_driver_drops_a_real_actors_poll_failure_and_keeps_its_other_lines(ray_cluster, capsys):
    import ray

    from efftx.console import filter_worker_logs

    class PreemptionWatcher:  # named as Ray Train's actor: its log lines reach the driver with that actor name
        def fail_a_poll(self, token):
            import logging

            try:
                raise ConnectionError(f"the GCS is gone {token}")
            except ConnectionError:
                logging.getLogger("ray.train").warning("PreemptionWatcher poll failed", exc_info=True)
            print(f"[efftx] watcher line {token}", flush=True)

    assert filter_worker_logs()
    token = uuid.uuid4().hex
    watcher = ray.remote(num_cpus=0.01)(PreemptionWatcher).remote()
    ray.get(watcher.fail_a_poll.remote(token))
    out, deadline = "", time.monotonic() + 30
    while f"watcher line {token}" not in out and time.monotonic() < deadline:
        time.sleep(0.2)
        captured = capsys.readouterr()
        out += captured.out + captured.err
    ray.kill(watcher)
    assert f"[efftx] watcher line {token}" in out, out
    assert "poll failed" not in out and "Traceback" not in out and f"the GCS is gone {token}" not in out, out


POLL_FAILED = ["PreemptionWatcher poll failed", "Traceback (most recent call last):",
               '  File "/x/ray/train/v2/_internal/execution/preemption.py", line 175, in _poll_once',
               "    drained = _get_draining_nodes() or {}", "ray.exceptions.RpcError: failed to connect to all addresses",
               "", "During handling of the above exception, another exception occurred:", "",
               "Traceback (most recent call last):", '  File "/x/y.py", line 1, in f', "KeyError: 'gcs'"]


def test_the_watchers_poll_failures_are_dropped_with_their_tracebacks_and_nothing_else():
    from efftx.console import PollFailures

    polls, watcher, other = PollFailures(), {"actor_name": "PreemptionWatcher", "pid": 7}, {"pid": 8}
    assert polls.keep(other, POLL_FAILED) == POLL_FAILED  # another process's lines: untouched
    news = "PreemptionWatcher: node abc is draining, deadline 30 s"
    # a traceback split over batches, a chained exception, then the watcher's other lines stay
    assert polls.keep(watcher, POLL_FAILED[:3]) == []
    assert polls.keep(other, ["[efftx] step 1/2"]) == ["[efftx] step 1/2"]  # another process between the batches
    assert polls.keep(watcher, POLL_FAILED[3:] + [news, "", "Traceback (most recent call last):"]) == [
        news, "", "Traceback (most recent call last):"]  # a traceback not after the warning is not dropped
    assert polls.keep(watcher, ["PreemptionWatcher poll failed", "Traceback (most recent call last):",
                                "  File ...", "SomeOddThing: broke", news]) == ["SomeOddThing: broke", news]


STEP_LINES = ["[efftx] step 5/10 loss 5.1234 lr 3.00e-03 tok/s 18,062 mfu 18.37% eta 12s",
              "[efftx] step 10/10 loss 4.9000 lr 3.00e-04 tok/s 8,635 mfu 8.78% eta 0s"]


def test_progress_bar_redraws_in_place_and_other_output_starts_a_new_line():
    import io

    from efftx.console import Progress

    out = io.StringIO()
    bar = Progress(out)
    assert not bar.draw("[efftx] eval step 0: val_bpb 7.88")  # not a step line: not drawn
    assert bar.draw(STEP_LINES[0]) and bar.shown
    assert out.getvalue() == "\r\x1b[2K[############............] step 5/10 loss 5.1234 tok/s 18,062 eta 12s"
    bar.end()  # other output follows: the bar keeps its line
    assert out.getvalue().endswith("eta 12s\n") and not bar.shown
    bar.draw(STEP_LINES[1])
    assert out.getvalue().endswith("[########################] step 10/10 loss 4.9000 tok/s 8,635 eta 0s\n")


@pytest.mark.parametrize("env, tty, mode", [("", True, "bar"), ("", False, "lines"), ("lines", True, "lines"),
                                            ("bar", False, "bar")])
def test_progress_mode_follows_the_terminal_unless_told(monkeypatch, env, tty, mode):
    from efftx.console import progress_mode

    class Stream:
        def isatty(self):
            return tty

    monkeypatch.setenv("EFFTX_PROGRESS", env or "auto")
    assert progress_mode(Stream()) == mode
