"""`ray job submit` against a real `ray start --head` cluster, exactly as the README shows.

This test starts its own cluster (in its own temp dir) and stops it by killing that cluster's processes,
so it never touches the session's in-process cluster; conftest orders it before any test that starts one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_cluster(temp_dir: str) -> None:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                proc.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def test_ray_job_submit_to_ray_start_head(efftx_home):
    temp_dir = tempfile.mkdtemp(prefix="efftx-ray-", dir="/tmp")
    dash = free_port()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    start = [str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--port", str(free_port()),
             "--dashboard-port", str(dash), "--temp-dir", temp_dir, "--disable-usage-stats"]
    try:
        proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        submit = [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", ".",
                  "--", "python", "jobs/train_sinkhorn.py", "--recipe", "sinkhorn_debug", "--run-name", "submitted",
                  "--set", "train.steps=10", "--set", "train.eval_every=5"]
        job = subprocess.run(submit, cwd=REPO, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                             text=True, timeout=600)
        assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
        summary = json.loads(next(line for line in reversed(job.stdout.splitlines()) if line.startswith("{")))
        assert summary["final_step"] == 10 and summary["run_name"] == "submitted"
        # the job ran in the cluster's venv with the client's environment: outputs in the test's efftx home
        assert Path(summary["export_path"]).is_relative_to(efftx_home)
        assert Path(summary["export_path"], "model.safetensors").is_file()
    finally:
        kill_cluster(temp_dir)
        time.sleep(1)
