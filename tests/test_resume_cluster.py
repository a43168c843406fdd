"""Resume on a real `ray start --head` cluster after the driver or a worker is SIGKILLed right after a checkpoint
that Ray Train has not committed yet (it learns of reports by polling): the run goes on from that newest complete
checkpoint, with the per-step losses of an uninterrupted run.

The cluster has its own temp dir and its own token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH to a file this module
writes; ~/.ray is never read); drivers are `python jobs/train_lm.py` with RAY_ADDRESS pointing at it. The killed
attempts run with RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=3 (Ray Train's poll, 2 s by default) so that the window between
a checkpoint's manifest and Ray's commit is wide enough to kill in every time; the killed driver's Train controller
(an actor Ray reaps only some time after its driver died, long enough to poll and commit) is killed with it. An
uninterrupted run of the same config runs beside them for the reference losses. The rerun starts once the killed
job's placement group has let its CPU go (else it would wait for it without a word, Ray Train retrying the start
without limit); a driver that runs too long, or a CPU never freed, fails with the driver's output, `ray status` and
the cluster's placement groups (CI once saw a rerun run past 900 s with neither).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from netutil import free_port
from test_job_submit import kill_cluster

from efftx.cluster import session_of, start_node

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 30
SETS = ["--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=5", "--set", "train.eval_every=10",
        "--set", "train.keep_checkpoints=2"]


@pytest.fixture(scope="module")
def cluster():
    """A 2-CPU `ray start --head` cluster with token auth -> (its temp dir, the env of its clients)."""
    temp_dir = tempfile.mkdtemp(prefix="efftx-ray-", dir="/tmp")
    token = Path(tempfile.mkdtemp(prefix="efftx-token-")) / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    port = free_port()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token)}
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(var, None)
    start = [str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard",
             "false", "--temp-dir", temp_dir, "--disable-usage-stats"]
    try:
        start_node(start, 3, session_of, env)  # `ray start`, started again if the raylet registers late
        yield temp_dir, {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        kill_cluster(temp_dir)
        time.sleep(1)


class Driver:
    """`python jobs/train_lm.py --recipe lm_debug ...` against the cluster, its output in a file."""

    def __init__(self, env: dict, name: str, out_dir: Path, *extra: str, poll_s: float | None = None):
        env = {**env, **({"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(poll_s)} if poll_s else {})}
        self.env = env
        cmd = [sys.executable, "jobs/train_lm.py", "--recipe", "lm_debug", "--run-name", name, "--workers", "2",
               *SETS, *extra]
        self.log = out_dir / f"{name}-{time.time_ns()}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)

    def out(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        assert self.proc.poll() is None, f"the driver exited ({self.proc.returncode}):\n{self.out()[-4000:]}"
        return True

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.time() + timeout
        while self.alive() and time.time() < deadline:
            if m := re.search(pattern, self.out()):
                return m
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the driver's output:\n{self.out()[-4000:]}")

    def finish(self, timeout: float = 600) -> tuple[dict, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # what the driver and the cluster were doing, in the failure itself
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the driver ran past {timeout:g} s; its output:\n{self.out()[-6000:]}\n"
                                 f"the cluster:\n{cluster_state(self.env)}") from None
        out = self.out()
        assert self.proc.returncode == 0, out[-4000:]
        return json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))), out


def cluster_state(env: dict) -> str:
    """`ray status` (resources in use, pending demands) and the placement groups, as a client of the cluster."""
    code = ("import ray; ray.init(); from ray.util import placement_group_table as t; "
            "[print(v['placement_group_id'], v['state'], v['bundles'], v['stats']) for v in t().values()]")
    out = []
    for cmd in ([str(BIN / "ray"), "status", "--address", env["RAY_ADDRESS"]], [sys.executable, "-c", code]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
            out.append(done.stdout[-3000:] + done.stderr[-1500:])
        except subprocess.TimeoutExpired:
            out.append(f"{cmd[:2]} ran past 60 s")
    return "\n".join(out)


def wait_for_free_cpus(env: dict, need: float, timeout: float = 180) -> None:
    """Block until the cluster has ``need`` CPUs free (a killed job's placement group released), else fail with
    the cluster's state rather than leave the next driver waiting for a placement group that never comes."""
    code = ("import ray, sys, time; ray.init(); deadline = time.time() + float(sys.argv[2])\n"
            "while ray.available_resources().get('CPU', 0) < float(sys.argv[1]) - 1e-9 and time.time() < deadline:\n"
            "    time.sleep(0.5)\n"
            "print(ray.available_resources().get('CPU', 0))")
    done = subprocess.run([sys.executable, "-c", code, str(need), str(timeout)], env=env, capture_output=True,
                          text=True, timeout=timeout + 120)
    free = float(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else None
    assert free is not None and free >= need - 1e-9, (
        f"{need:g} CPUs not free after {timeout:g} s ({free}; {done.stderr[-1500:]}):\n{cluster_state(env)}")


def run_dir(name: str) -> Path:
    return Path(os.environ["EFFTX_HOME"], "runs", name)


def manifest_steps(run: Path) -> dict[str, int]:
    """Checkpoint folder -> step, for the folders whose manifest is written (complete ones)."""
    out = {}
    for m in run.glob("checkpoint_*/efftx_manifest.json"):
        try:
            out[m.parent.name] = json.loads(m.read_text())["step"]
        except (OSError, ValueError):
            pass
    return out


def ray_committed(run: Path) -> dict[str, int] | None:
    """Ray Train's own committed checkpoints (its snapshot), folder -> step; None while it is being rewritten."""
    try:
        snap = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        return None
    steps = manifest_steps(run)
    return {r["checkpoint_dir_name"]: steps.get(r["checkpoint_dir_name"], -1) for r in snap["checkpoint_results"]}


def wait_for_uncommitted_checkpoint(driver: Driver, run: Path, after: int = 0) -> tuple[str, int]:
    """Block until a complete checkpoint newer than step ``after`` exists that Ray has not committed, while Ray
    has committed an older one -> (its folder, its step)."""
    deadline = time.time() + 300
    while driver.alive() and time.time() < deadline:
        committed = ray_committed(run)
        newer = {n: s for n, s in manifest_steps(run).items() if committed is not None and n not in committed
                 and s > after}
        if committed and newer:
            name = max(newer, key=newer.get)
            return name, newer[name]
        time.sleep(0.02)
    raise AssertionError("no uncommitted complete checkpoint appeared")


def train_controller(poll_s: float):
    """The process of the Ray Train controller whose driver set ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` to ``poll_s``
    (Ray Train passes it on to its controller; the uninterrupted run beside it leaves it unset)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "TrainController" in " ".join(proc.info["cmdline"] or []) and (
                    proc.environ().get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S") == str(poll_s)):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    assert len(found) == 1, [p.info["cmdline"] for p in found]
    return found[0]


def losses(summary: dict) -> dict[int, set[float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    out: dict[int, set[float]] = {}
    for m in client.get_metric_history(summary["mlflow_run_id"], "loss"):
        out.setdefault(m.step, set()).add(m.value)
    return out


RANK0 = r"\(RayTrainWorker pid=(\d+)\)\S* \[efftx\] "


def test_killed_worker_then_killed_driver_resume_from_the_newest_complete_checkpoints(cluster, tmp_path):
    import psutil

    from efftx.paths import default_tracking_uri
    from efftx.tracking import client_for

    _, env = cluster
    client_for(default_tracking_uri()).search_experiments()  # create the MLflow tables before two drivers race to
    reference = Driver(env, "uninterrupted", tmp_path)  # side by side: the cluster has a CPU for each
    run = run_dir("killed")
    attempt = Driver(env, "killed", tmp_path, "--set", "train.max_failures=1", poll_s=3)

    # 1. A worker is SIGKILLed right after a checkpoint Ray Train has not polled yet: the restart resumes from it.
    rank0 = int(attempt.wait_for(RANK0 + "starting step 0").group(1))
    name1, step1 = wait_for_uncommitted_checkpoint(attempt, run)
    os.kill(rank0, signal.SIGKILL)
    assert name1 not in (ray_committed(run) or {})
    resumed = attempt.wait_for(RANK0 + rf"resuming from checkpoint (\S+) \(step (\d+), files match its manifest; "
                               r"Ray Train's latest is step (\d+)\)")
    assert (resumed.group(2), resumed.group(3)) == (str(run / name1), str(step1))
    assert int(resumed.group(4)) < step1  # Ray alone would have restarted from an older checkpoint
    attempt.wait_for(RANK0 + f"resumed at step {step1}/{STEPS}")
    rank0 = int(resumed.group(1))

    # 2. The driver is SIGKILLed right after a newer checkpoint Ray has not polled: the rerun resumes from it. Its
    # Train controller (an actor: Ray reaps it only some time after its driver died, and it may poll and commit the
    # checkpoint meanwhile) dies with it, as on a driver's machine that fails.
    controller = train_controller(poll_s=3)  # found first: killed the moment the checkpoint is there
    name2, step2 = wait_for_uncommitted_checkpoint(attempt, run, after=step1)
    controller.kill()
    attempt.proc.send_signal(signal.SIGKILL)
    attempt.proc.wait()
    committed = ray_committed(run)
    assert name2 not in committed and max(committed.values()) < step2, (committed, name2, step2)
    deadline = time.time() + 60  # the job's workers die with their driver
    while psutil.pid_exists(rank0) and time.time() < deadline:
        time.sleep(0.2)
    wait_for_free_cpus(env, 1.0)  # the uninterrupted run holds the other one
    summary, out = Driver(env, "killed", tmp_path).finish()  # the same command again
    assert (f"resuming from checkpoint {run / name2} (step {step2}, files match its manifest; "
            f"Ray Train's latest is step {max(committed.values())})") in out, out[-4000:]
    assert f"resumed at step {step2}/{STEPS}" in out

    # 3. Bit-exact: every step's loss is the uninterrupted run's (steps run twice logged one value).
    ref_summary, _ = reference.finish()
    ref, got = losses(ref_summary), losses(summary)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert len(ref[s]) == 1 and got[s] == ref[s], s
    assert summary["val_bpb"] == ref_summary["val_bpb"]
    # orphans beyond train.keep_checkpoints are gone (Ray's rotation did the rest)
    kept = manifest_steps(run)
    assert sorted(kept.values()) == [STEPS - 5, STEPS], kept
    assert {p.name for p in run.glob("checkpoint_*") if p.is_dir()} == set(kept)
