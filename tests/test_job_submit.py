"""`ray job submit` against a real `ray start --head` cluster, exactly as the README shows.

These tests start their own cluster (in its own temp dir) and stops it by killing that cluster's processes,
so it never touches the session's in-process cluster; conftest orders it before any test that starts one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from netutil import free_port

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def kill_cluster(temp_dir: str) -> None:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                proc.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


@pytest.fixture(scope="module")
def head_cluster():
    """A `ray start --head` cluster of 2 CPUs for this module's jobs -> (job submission address, env)."""
    temp_dir = tempfile.mkdtemp(prefix="efftx-ray-", dir="/tmp")
    dash = free_port()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    start = [str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--port", str(free_port()),
             "--dashboard-port", str(dash), "--temp-dir", temp_dir, "--disable-usage-stats"]
    try:
        proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        yield f"http://127.0.0.1:{dash}", env
    finally:
        kill_cluster(temp_dir)
        time.sleep(1)


def submit(head_cluster, *job: str) -> dict:
    """`ray job submit --working-dir . -- python JOB...` as the README shows; the job's final JSON line."""
    address, env = head_cluster
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--", "python", *job]
    proc = subprocess.run(cmd, cwd=REPO, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))


def test_ray_job_submit_to_ray_start_head(head_cluster, efftx_home):
    summary = submit(head_cluster, "jobs/train_sinkhorn.py", "--recipe", "sinkhorn_debug", "--run-name", "submitted",
                     "--set", "train.steps=10", "--set", "train.eval_every=5")
    assert summary["final_step"] == 10 and summary["run_name"] == "submitted"
    # the job ran in the cluster's venv with the client's environment: outputs in the test's efftx home
    assert Path(summary["export_path"]).is_relative_to(efftx_home)
    assert Path(summary["export_path"], "model.safetensors").is_file()


def test_dalle_job_submit_trains_the_dvae_then_dalle(head_cluster, efftx_home):
    short = ["--set", "train.steps=10", "--set", "train.eval_every=5"]
    both = submit(head_cluster, "jobs/train_dalle.py", "--recipe", "dalle_shapes_debug", "--run-name", "submitted",
                  *short, "--vae-set", "train.steps=10", "--vae-set", "train.eval_every=5")
    assert both["dvae"]["final_step"] == both["dalle"]["final_step"] == 10
    assert both["dalle"]["run_name"] == "submitted-dalle"
    export = Path(both["dalle"]["export_path"])
    assert export.is_relative_to(efftx_home) and (export / "model.safetensors").is_file()
    assert json.loads((export / "config.json").read_text())["config"]["dalle"]["vae_path"] == both["dvae"]["export_path"]
