"""bench/train_throughput.py's load filter: only steps during which other processes left the CPUs idle count."""

import importlib.util
import sys
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "bench" / "train_throughput.py"
_spec = importlib.util.spec_from_file_location("train_throughput", _path)
tt = importlib.util.module_from_spec(_spec)
sys.modules["train_throughput"] = tt
_spec.loader.exec_module(tt)


class FakeMachine:
    """A clock and /proc/stat: each step lasts ``seconds[i]``; ``others[i]`` CPU-seconds are used by others meanwhile."""

    def __init__(self, seconds, others):
        self.seconds, self.others, self.i, self.now, self.busy, self.own = list(seconds), list(others), 0, 0.0, 0.0, 0.0

    def step(self):  # the bench's own 2 threads keep both CPUs busy: its CPU time counts as busy, not as others'
        self.now += self.seconds[self.i]
        self.own += 2 * self.seconds[self.i]
        self.busy += self.others[self.i] + 2 * self.seconds[self.i]
        self.i += 1


def install(monkeypatch, machine):
    monkeypatch.setattr(tt, "busy_cpu_seconds", lambda: machine.busy)
    monkeypatch.setattr(tt.time, "perf_counter", lambda: machine.now)
    monkeypatch.setattr(tt.time, "process_time", lambda: machine.own)
    monkeypatch.setattr(tt.os, "cpu_count", lambda: 2)


def test_loaded_steps_are_left_out_and_replaced(monkeypatch):
    # steps 1 and 3 (10 s) ran while others kept a whole CPU busy: half the machine
    machine = FakeMachine([1.0, 10.0, 1.2, 10.0, 0.8, 9.0], [0.0, 10.0, 0.0, 10.0, 0.0, 0.0])
    install(monkeypatch, machine)
    timing = tt.median_step(machine.step, warmup=0, steps=3, quiet=0.05, max_steps=6)
    assert machine.i == 5  # stopped at the third clean step
    assert timing.clean == pytest.approx([1.0, 1.2, 0.8]) and timing.total == 5
    assert timing.seconds == pytest.approx(1.0) and timing.label == "clean 3/5"


def test_no_clean_step_falls_back_to_all_and_says_so(monkeypatch):
    machine = FakeMachine([4.0, 5.0, 6.0], [4.0, 5.0, 6.0])
    install(monkeypatch, machine)
    timing = tt.median_step(machine.step, warmup=0, steps=2, quiet=0.05, max_steps=3)
    assert machine.i == 3 and timing.seconds == 5.0 and timing.label == "clean 0/3 (loaded)"


def test_quiet_share_one_counts_every_step(monkeypatch):
    machine = FakeMachine([1.0, 3.0], [0.5, 1.5])  # others at 25%: counted when the filter is off
    install(monkeypatch, machine)
    timing = tt.median_step(machine.step, warmup=0, steps=2, quiet=1.0)
    assert machine.i == 2 and timing.seconds == 2.0 and timing.label == "clean 2/2"
