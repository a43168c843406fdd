"""Bad input to the job script: a clear message, exit code 2, no traceback (no Ray needed)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, message", [
    (["--recipe", "nope"], "unknown recipe 'nope'"),
    (["--recipe", "lm_debug", "--set", "train.lrr=1"], "unknown config key 'train.lrr' (did you mean 'train.lr'"),
    (["--recipe", "lm_debug", "--set", "train.steps=many"], "train.steps expects an integer"),
    (["--recipe", "lm_debug", "--set", "data.corpus=/no/such/enwik8.gz"], "corpus not found: /no/such/enwik8.gz"),
    (["--recipe", "lm_debug", "--set", "model.kv_heads=3"], "model.heads=4 must be a multiple of model.kv_heads=3"),
])
def test_bad_input_exits_non_zero_with_message(args, message):
    proc = subprocess.run([sys.executable, "jobs/train_lm.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_print_config_shows_resolved_defaults():
    proc = subprocess.run([sys.executable, "jobs/train_lm.py", "--recipe", "lm_debug", "--run-name", "x",
                           "--set", "train.lr=0.01", "--print-config"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"lr": 0.01' in proc.stdout and "sqlite:///" in proc.stdout
