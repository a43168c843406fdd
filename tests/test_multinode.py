"""A real three-node Ray cluster on this machine: a head and two worker nodes, each `ray start` with its own temp dir
and one CPU, token authentication on. Runs keep their checkpoints in a real S3 server (moto, ``s3_server``); run 1
logs to an MLflow tracking server (``python -m efftx.tracking_server``, its artifacts in the same store), the others
to sqlite in the test home (on the disk every node shares).

1. A 2-worker DeepSpeed job submitted with ``python -m efftx.cluster submit`` (the README's commands) spreads over the
   two worker nodes (``scaling.placement_strategy=SPREAD``): its ranks log different node ids.
2. Node loss, fixed size: every Ray process of one worker node is SIGKILLed right after a checkpoint; a new worker
   node joins; the run (``train.max_failures=1``) resumes on it from the last checkpoint, and every step's loss equals
   run 1's (same config, uninterrupted). The timeline (step killed, step resumed, seconds lost) is printed.
3. Node loss, elastic (``scaling.min_workers=1``): the run restarts on the remaining node alone, without any capacity
   coming back, and finishes; the world_size metric drops from 2 to 1.

0. Before those, a cluster of its own whose nodes start with ``--serve-ingress haproxy``: through HAProxy on the head's
   Serve port, an application's replicas on both worker nodes answer, straight from HAProxy (its stats), never
   through its backup, Serve's fallback proxy.

The drivers of 2 and 3 run as subprocesses (`python jobs/train_lm.py` with RAY_ADDRESS), never in this process,
whose own Ray cluster starts after these tests (conftest orders ``own_cluster`` tests first).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from netutil import free_port
from test_tracking_server import bucket, mlflow_server  # noqa: F401  (fixtures: the MLflow server, artifacts in S3)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 40
BUCKET = "efftx-multinode"
SETS = ["--recipe", "lm_debug", "--workers", "2",
        "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=10", "--set", "train.eval_every=10",
        "--set", "train.sample_every=0", "--set", "scaling.cpus_per_worker=1",
        "--set", "scaling.placement_strategy=SPREAD", "--set", f"scaling.storage_path=s3://{BUCKET}/runs"]
WORKER_LINE = re.compile(r"\[efftx\] workers: (\d+) on (\d+) node\(s\): (.*)")


def kill_node(temp_dir: str) -> list[int]:
    """SIGKILL every process of one Ray node: those naming its temp dir (raylet, log monitor) and all their
    descendants (the dashboard and runtime-env agents, the Ray workers: RayTrainWorker actors)."""
    from efftx.cluster import kill_node as kill

    return kill(temp_dir + "/")


class Cluster:
    """The head (``python -m efftx.cluster up --num-cpus 0``: jobs, no training) and its worker nodes."""

    def __init__(self, root: Path, env: dict[str, str], ingress: str = "proxy"):
        self.root, self.env, self.ingress = root, env, ingress
        self.gcs_port, self.dash_port = free_port(), free_port()
        self.workers: dict[str, str] = {}  # name -> temp dir

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def jobs_address(self) -> str:
        return f"http://127.0.0.1:{self.dash_port}"

    def start_head(self, **env: str) -> None:
        cmd = [str(BIN / "python"), "-m", "efftx.cluster", "up", "--num-cpus", "0", "--port", str(self.gcs_port),
               "--dashboard-port", str(self.dash_port), "--temp-dir", str(self.root / "head"),
               "--ray-client-server-port", str(free_port()), "--metrics-export-port", str(free_port()),
               "--serve-ingress", self.ingress]
        # no --dashboard-agent-listen-port: `up` picks a free one and, when another process takes it before the
        # agent binds it (seen in `make test`: no job was ever accepted), starts the head again on another
        proc = subprocess.run(cmd, env={**self.env, **env}, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    def add_workers(self, *names: str) -> None:
        """`python -m efftx.cluster join --address HEAD --num-cpus 1` (`ray start`, token auth) per name (side by
        side), each with its own temp dir."""
        procs = {}
        for name in names:
            temp_dir = str(self.root / name)
            cmd = [str(BIN / "python"), "-m", "efftx.cluster", "join", "--address", self.address, "--num-cpus", "1",
                   "--temp-dir", temp_dir, "--dashboard-agent-listen-port", str(free_port()),
                   "--metrics-export-port", str(free_port()), "--serve-ingress", self.ingress]
            # behind HAProxy every node's HAProxy binds Serve's HTTP port: nodes sharing one machine's ports need
            # Ray's per-worker-node port (a cluster of machines keeps the one port on every node)
            env = {**self.env, **({"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(free_port())}
                                  if self.ingress == "haproxy" else {})}
            procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.workers[name] = temp_dir
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=400)
            assert proc.returncode == 0, f"worker node {name}: {out[-3000:]}"

    def node_ids(self) -> dict[str, str]:
        """Live node name (head, w1, ...) -> Ray node id, from the cluster's own node table."""
        script = ("import json, ray; ray.init(logging_level='ERROR'); print(json.dumps({n['NodeID']: "
                  "n['ObjectStoreSocketName'] for n in ray.nodes() if n['Alive']}))")
        proc = subprocess.run([sys.executable, "-c", script], env={**self.env, "RAY_ADDRESS": self.address},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        sockets = json.loads(proc.stdout.strip().splitlines()[-1])
        dirs = {"head": str(self.root / "head"), **self.workers}
        return {name: node for node, sock in sockets.items() for name, d in dirs.items() if sock.startswith(d + "/")}

    def kill(self, name: str) -> list[int]:
        return kill_node(self.workers[name])

    def stop(self) -> None:
        for temp_dir in [*self.workers.values(), str(self.root / "head")]:
            kill_node(temp_dir)


# A deployment answering with the id of the node its replica runs on: two replicas, one on each worker node.
WHERE = """
import sys, ray
from ray import serve

ray.init(logging_level="ERROR")


@serve.deployment(num_replicas=2, max_replicas_per_node=1, ray_actor_options={"num_cpus": 0.5})
class Where:
    async def __call__(self, request):
        return ray.get_runtime_context().get_node_id()


serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[1])})
serve.run(Where.bind(), route_prefix="/")
"""


@pytest.mark.slow
@pytest.mark.own_cluster
def test_0_behind_haproxy_the_heads_address_serves_the_replicas_of_both_worker_nodes():
    """A cluster whose nodes start with ``python -m efftx.cluster up|join --serve-ingress haproxy``: an application
    with one replica on each worker node answers through HAProxy on the head's Serve port from both nodes (HAProxy
    passes requests straight to replicas on other nodes). Runs before, and apart from, the module's cluster below."""
    from collections import Counter

    import requests

    from test_serve_ingress import listener

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")
           and not k.startswith("RAY_SERVE_")}
    c = Cluster(Path(tempfile.mkdtemp(prefix="efftx-haproxy-nodes-", dir="/tmp")),
                {**env, "PATH": f"{BIN}:{env['PATH']}"}, ingress="haproxy")
    port, stats, seen = free_port(), free_port(), Counter()
    try:
        c.start_head(RAY_SERVE_HAPROXY_STATS_PORT=str(stats))  # the head's HAProxy reports what it sent where
        c.add_workers("w1", "w2")
        proc = subprocess.run([sys.executable, "-c", WHERE, str(port)], cwd=REPO,
                              env={**c.env, "RAY_ADDRESS": c.address}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        url, deadline = f"http://127.0.0.1:{port}/", time.time() + 120
        while time.time() < deadline:  # up once HAProxy has the application's replicas
            try:
                if requests.get(url, timeout=10).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        for _ in range(40):  # then every answer is a replica's
            res = requests.get(url, timeout=10)
            seen[res.text if res.status_code == 200 else f"HTTP {res.status_code}: {res.text[:100]}"] += 1
        assert listener(port) == "haproxy"
        nodes = c.node_ids()
        assert set(seen) == {nodes["w1"], nodes["w2"]}, (seen, nodes)
        # HAProxy sent them to the replicas themselves, not to its backup (Serve's fallback proxy on the head)
        table = requests.get(f"http://127.0.0.1:{stats}/stats;csv", timeout=10).text.lstrip("# ").splitlines()
        rows = [dict(zip(table[0].split(","), line.split(","))) for line in table[1:]]
        sent = {row["svname"]: int(row["stot"] or 0) for row in rows if row["pxname"] == "http-default"}
        replicas = {name: n for name, n in sent.items() if name.startswith("SERVE_REPLICA")}
        assert len(replicas) == 2 and all(n > 0 for n in replicas.values()), sent
        assert sum(replicas.values()) >= 40 and not [n for name, n in sent.items() if "fallback" in name and n], sent
    finally:
        c.stop()
        time.sleep(1)


@pytest.fixture(scope="module")
def cluster(s3_server):
    root = Path(tempfile.mkdtemp(prefix="efftx-nodes-", dir="/tmp"))
    s3_server.create_bucket(BUCKET)
    # the token of the test session (conftest: RAY_AUTH_TOKEN_PATH, RAY_AUTH_MODE=token); the S3 credentials reach
    # the job drivers on the head through its environment
    env = {**os.environ, **s3_server.env(), "PATH": f"{BIN}:{os.environ['PATH']}"}
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(var, None)
    c = Cluster(root, env)
    try:
        c.start_head()
        c.add_workers("w1", "w2")
        yield c
    finally:
        c.stop()
        time.sleep(1)


class Driver:
    """`python jobs/train_lm.py` against the cluster (RAY_ADDRESS), its output in a file."""

    def __init__(self, cluster: Cluster, name: str, out_dir: Path, *extra: str):
        cmd = [sys.executable, "jobs/train_lm.py", "--run-name", name, *SETS, *extra]
        self.log = out_dir / f"{name}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env={**cluster.env, "RAY_ADDRESS": cluster.address},
                                         stdout=f, stderr=subprocess.STDOUT, text=True)

    def out(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if m := re.search(pattern, self.out()):
                return m
            assert self.proc.poll() is None, f"the driver exited ({self.proc.returncode}):\n{self.out()[-4000:]}"
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} in the driver's output:\n{self.out()[-4000:]}")

    def finish(self) -> tuple[dict, str]:
        self.proc.wait(timeout=600)
        out = self.out()
        assert self.proc.returncode == 0, out[-4000:]
        return last_json(out), out


def last_json(out: str) -> dict:
    return json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{")))


def worker_lines(out: str) -> list[dict[int, str]]:
    """Each attempt's placement, in order: rank -> node id."""
    attempts = []
    for m in WORKER_LINE.finditer(out):
        ranks = dict(re.findall(r"rank (\d+) on node ([0-9a-f]+)", m.group(3)))
        attempts.append({int(r): n for r, n in ranks.items()})
        assert len(attempts[-1]) == int(m.group(1)) and len(set(attempts[-1].values())) == int(m.group(2))
    return attempts


def history(summary: dict, metric: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    return sorted(client.get_metric_history(summary["mlflow_run_id"], metric), key=lambda m: (m.timestamp, m.step))


def losses(summary: dict) -> dict[int, set[float]]:
    out: dict[int, set[float]] = {}
    for m in history(summary, "loss"):
        out.setdefault(m.step, set()).add(m.value)
    return out


@pytest.fixture(scope="module")
def spread_run(cluster, mlflow_server, tmp_path_factory):
    """Run 1, submitted as the README does, logging to the MLflow server (python -m efftx.tracking_server, its
    artifacts in the S3 bucket): -> (summary, output, node ids before the run)."""
    nodes = cluster.node_ids()
    entry = ["python", "jobs/train_lm.py", "--run-name", "spread", *SETS, "--set", f"tracking.uri={mlflow_server}"]
    cmd = [str(BIN / "python"), "-m", "efftx.cluster", "submit", "--address", cluster.jobs_address,
           "--working-dir", ".", "--", *entry]
    proc = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return last_json(out), out, nodes


@pytest.mark.slow
@pytest.mark.own_cluster
def test_a_two_worker_job_spreads_over_the_worker_nodes_with_checkpoints_in_s3_and_metrics_in_mlflow(
        spread_run, s3_server):
    summary, out, nodes = spread_run
    assert summary["final_step"] == STEPS
    assert summary["tracking_uri"].startswith("http://127.0.0.1:")  # the metrics below are read over HTTP
    (placement,) = worker_lines(out)
    assert sorted(placement.values()) == sorted([nodes["w1"], nodes["w2"]]), (placement, nodes)
    keys = s3_server.keys(BUCKET, "runs/spread/")
    assert summary["checkpoint"].startswith(f"s3://{BUCKET}/runs/spread/checkpoint_000000{STEPS}_")
    ckpt = summary["checkpoint"].removeprefix(f"s3://{BUCKET}/")
    assert f"{ckpt}/efftx_manifest.json" in keys and f"{ckpt}/deepspeed/mp_rank_00_model_states.pt" in keys, keys
    assert "runs/spread/export/config.json" in keys
    assert not (Path(os.environ["EFFTX_HOME"]) / "runs" / "spread").exists()  # nothing of it on local disk
    got = losses(summary)
    assert sorted(got) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in got.values())
    assert [(m.step, m.value) for m in history(summary, "world_size")] == [(0, 2.0)]
    assert [m.value for m in history(summary, "nodes")] == [2.0]


def timeline(summary: dict, killed_at: float, resumed_from: int) -> dict:
    """From the loss history's timestamps: the last step logged before the kill, the step the run resumed from,
    and the seconds from the kill until the first step after the restart and until the run was past the step it
    had reached when it was killed."""
    entries = history(summary, "loss")
    before = [m for m in entries if m.timestamp / 1000 <= killed_at]
    after = [m for m in entries if m.timestamp / 1000 > killed_at]
    step_killed = max(m.step for m in before)
    first = next(m for m in after if m.step == resumed_from + 1)
    caught_up = next(m for m in after if m.step == step_killed + 1)
    return {"step_killed": step_killed, "step_resumed": resumed_from,
            "seconds_to_first_step_after_restart": round(first.timestamp / 1000 - killed_at, 1),
            "seconds_lost": round(caught_up.timestamp / 1000 - killed_at, 1)}


@pytest.mark.slow
@pytest.mark.own_cluster
def test_a2_serve_runs_two_replicas_on_the_two_worker_nodes_behind_one_address(cluster, s3_server, debug_exports,
                                                                               tmp_path):
    """The text app deployed to the cluster (``python -m efftx.serving.deploy``, i.e. ``serve deploy``) with two
    replicas, at most one per node, loading their model from the object store (an export at an s3:// URI): both
    worker nodes serve it, behind the head's one HTTP address (``GET /models/info`` names the replica's node)."""
    import requests
    import yaml

    client = s3_server.client()
    for f in Path(debug_exports["target"]).iterdir():
        client.upload_file(str(f), BUCKET, f"exports/target/{f.name}")
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "proxy_location": "HeadOnly",  # one HTTP address (every node of this test shares one machine's ports)
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "text", "route_prefix": "/", "import_path": "efftx.serving.text:build",
                          "args": {"target": f"s3://{BUCKET}/exports/target", "name": "cluster"},
                          "deployments": [{"name": "TextGenerator", "num_replicas": 2, "max_replicas_per_node": 1}]}]}))
    proc = subprocess.run([sys.executable, "-m", "efftx.serving.deploy", str(config), "--address", cluster.jobs_address],
                          cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    url, seen = f"http://127.0.0.1:{port}", {}
    try:
        deadline = time.time() + 240
        while len(seen) < 2 and time.time() < deadline:
            try:
                res = requests.get(f"{url}/models/info", timeout=10)
                if res.status_code == 200:
                    replica = res.json()["replica"]
                    seen[replica["node_id"]] = replica["id"]
            except requests.RequestException:
                pass
            time.sleep(0.2)
        nodes = cluster.node_ids()
        assert set(seen) == {nodes["w1"], nodes["w2"]}, (seen, nodes)
        assert len(set(seen.values())) == 2  # two replicas
        res = requests.post(f"{url}/generate", json={"prompt": "def ", "max_new_tokens": 8, "temperature": 0},
                            timeout=120)
        assert res.status_code == 200 and res.json()["results"]["base"]["tokens"] == 8, res.text
    finally:  # the replicas hold CPU shares the training tests below need
        subprocess.run([str(BIN / "serve"), "shutdown", "-y", "--address", cluster.jobs_address], env=cluster.env,
                       capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.own_cluster
def test_b_a_lost_worker_node_is_survived_by_resuming_on_a_new_node_with_the_uninterrupted_losses(
        cluster, spread_run, tmp_path):
    reference, _, _ = spread_run
    nodes = cluster.node_ids()
    driver = Driver(cluster, "nodeloss", tmp_path, "--set", "train.max_failures=1")
    driver.wait_for(r"\[efftx\] checkpoint saved at step 10: ")
    killed_at = time.time()
    assert cluster.kill("w2")
    cluster.add_workers("w3")  # capacity comes back: a new node
    resumed = driver.wait_for(r"\[efftx\] resuming from checkpoint s3://\S+/nodeloss/checkpoint_\S+ \(step (\d+), "
                              r"files match its manifest")
    step = int(resumed.group(1))
    summary, out = driver.finish()
    assert f"resumed at step {step}/{STEPS}" in out
    first, second = worker_lines(out)
    after = cluster.node_ids()
    assert sorted(first.values()) == sorted([nodes["w1"], nodes["w2"]])
    assert sorted(second.values()) == sorted([nodes["w1"], after["w3"]])  # the lost node's rank runs on the new one

    ref, got = losses(reference), losses(summary)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s] == ref[s], (s, got[s], ref[s])  # steps run twice logged the same value
    assert summary["val_bpb"] == reference["val_bpb"]
    assert [(m.step, m.value) for m in history(summary, "world_size")] == [(0, 2.0), (step, 2.0)]
    t = timeline(summary, killed_at, step)
    print(f"\n[timeline] fixed size, node w2 killed, node w3 added: {json.dumps(t)}")
    assert 10 <= t["step_resumed"] <= t["step_killed"] < STEPS


@pytest.mark.slow
@pytest.mark.own_cluster
def test_c_an_elastic_run_continues_on_the_remaining_node_without_waiting_for_capacity(cluster, tmp_path):
    nodes = cluster.node_ids()
    driver = Driver(cluster, "elastic", tmp_path, "--set", "scaling.min_workers=1", "--set", "train.max_failures=1",
                    "--set", "scaling.start_timeout_s=10")
    driver.wait_for(r"\[efftx\] checkpoint saved at step 10: ")
    killed_at = time.time()
    first = worker_lines(driver.out())[0]
    assert sorted(first.values()) == sorted([nodes["w1"], nodes["w3"]])
    assert cluster.kill("w3")  # no node is added
    resumed = driver.wait_for(r"\[efftx\] resuming from checkpoint s3://\S+/elastic/checkpoint_\S+ \(step (\d+), ")
    step = int(resumed.group(1))
    summary, out = driver.finish()
    assert summary["final_step"] == STEPS
    assert re.search(rf"resumed at step {step}/{STEPS} \([\d,]+ parameters, 1 workers", out)
    assert worker_lines(out)[1] == {0: nodes["w1"]}
    assert [(m.step, m.value) for m in history(summary, "world_size")] == [(0, 2.0), (step, 1.0)]
    got = losses(summary)
    assert sorted(got) == list(range(1, STEPS + 1))
    t = timeline(summary, killed_at, step)
    print(f"\n[timeline] elastic (1, 2) workers, node w3 killed, nothing added: {json.dumps(t)}")


@pytest.mark.parametrize("overrides, match", [
    ({"scaling.min_workers": 3}, r"scaling.min_workers must be between 0 .* and scaling.num_workers=2 .*, got 3"),
    ({"scaling.min_workers": -1}, r"scaling.min_workers must be between 0"),
    ({"scaling.min_workers": 1, "engine.zero_stage": 2},
     r"scaling.min_workers=1 < scaling.num_workers=2 \(elastic\) needs engine.zero_stage=0: DeepSpeed cannot load "
     r"ZeRO-2 optimizer partitions"),
    ({"scaling.placement_strategy": "spread"}, r"scaling.placement_strategy must be one of PACK, SPREAD, "
                                               r"STRICT_SPREAD, STRICT_PACK; got 'spread'"),
    ({"scaling.start_timeout_s": -1.0}, r"scaling.start_timeout_s must be >= 0"),
])
def test_bad_scaling_keys_are_config_errors_naming_them(overrides, match):
    from efftx import recipes
    from efftx.errors import ConfigError

    cfg = recipes.get("lm_debug").override(overrides)
    cfg.name = "x"
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_the_scaling_keys_reach_ray_trains_scaling_config():
    import ray.train

    from efftx import recipes

    cfg = recipes.get("lm_debug").override({"scaling.min_workers": 1, "scaling.num_workers": 3,
                                            "scaling.placement_strategy": "STRICT_SPREAD"})
    cfg.name = "x"
    cfg.validate()
    sc = ray.train.ScalingConfig(num_workers=cfg.scaling.ray_num_workers,
                                 placement_strategy=cfg.scaling.placement_strategy)
    assert (sc.elasticity_enabled, sc.min_workers, sc.max_workers) == (True, 1, 3)
    fixed = recipes.get("lm_debug")
    assert fixed.scaling.ray_num_workers == 2 and not fixed.scaling.elastic
    # the elastic keys may change when a run resumes; the fixed worker count may not
    assert cfg.resumable("scaling.min_workers") and cfg.resumable("scaling.placement_strategy")
    assert not cfg.resumable("scaling.num_workers")
