"""The MLflow tracking server for clusters (``python -m efftx.tracking_server`` / ``make mlflow-server``), started for
real as a subprocess, its artifacts in a real S3-compatible bucket (moto_server on 127.0.0.1 with authentication on,
the ``s3_server`` fixture); this process talks to it over HTTP only and holds no S3 credentials.

Fast: a tracking URI where nothing answers, or where something that is not MLflow answers (a plain HTTP server on
127.0.0.1), is an error naming the URI before anything starts: for training (LaunchError, exit 2 from the job
script), efftx.promote, efftx.serving.ready, efftx.serving.deploy and efftx.generate (one line, exit 2); the server
command's bad input (a port in use, a missing bucket, a relative sqlite path) is one line, exit 2; experiments that
efftx creates on the server store their artifacts through it (mlflow-artifacts:/), and those land in the bucket.
Slow: a tiny training run with ``tracking.uri=http://...`` logs its params and metrics and registers its model with
@candidate on the server; the model's files are objects in the bucket; ``mlflow.pyfunc.load_model("models:/NAME@
candidate")`` predicts over HTTP; efftx.promote, serving.deploy's pinning and efftx.generate work against it.
"""

from __future__ import annotations

import http.server
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from netutil import free_port

from efftx import recipes
from efftx.errors import LaunchError

REPO = Path(__file__).resolve().parents[1]
BUCKET = "efftx-mlflow"
MODEL = "tsrv_lm"


# ------------------------------------------------------------------ helpers

def _dead_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


class _NotMlflow(http.server.BaseHTTPRequestHandler):
    status = 404

    def do_GET(self):  # noqa: N802
        body = b"<html><body>not here</body></html>"
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(params=[404, 401], ids=["not-mlflow", "auth-refused"])
def other_server(request):
    """A real HTTP server on 127.0.0.1 that is not MLflow: 404 + HTML, or 401 (a proxy asking for credentials)."""
    handler = type("Handler", (_NotMlflow,), {"status": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield request.param, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _run(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def _one_error_line(proc: subprocess.CompletedProcess, uri: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: ") and uri in lines[-1], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    return lines[-1]


# ------------------------------------------------------------------ a tracking URI that is not a usable server

def test_training_against_a_dead_server_fails_before_anything_starts(tmp_path):
    from efftx.train.launch import launch

    uri = _dead_uri()
    with pytest.raises(LaunchError) as err:
        launch(recipes.get("lm_debug").override({"name": "dead-mlflow", "tracking.uri": uri,
                                                 "scaling.storage_path": str(tmp_path / "runs")}))
    message = str(err.value)
    assert f"the MLflow tracking server {uri} cannot be reached: nothing listens there (connection refused)" in message
    assert "python -m efftx.tracking_server" in message
    assert not (tmp_path / "runs" / "dead-mlflow").exists()  # no run record, no checkpoint: nothing started


def test_the_job_script_says_so_in_one_line_with_exit_code_2(tmp_path):
    uri = _dead_uri()
    proc = _run(["jobs/train_lm.py", "--recipe", "lm_debug", "--run-name", "dead-mlflow-job",
                 "--set", f"tracking.uri={uri}", "--set", f"scaling.storage_path={tmp_path / 'runs'}"])
    line = _one_error_line(proc, uri)
    assert "cannot be reached" in line
    assert "started a local Ray instance" not in proc.stdout + proc.stderr  # Ray never started


def test_registry_commands_against_a_dead_server_name_it_and_exit_2(tmp_path, capsys):
    from efftx import generate, promote
    from efftx.serving import deploy, ready

    uri = _dead_uri()
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n  - name: text\n    import_path: efftx.serving.text:build\n"
                      f"    args:\n      target: models:/{MODEL}@champion\n")
    for main, argv in ((promote.main, [MODEL, "candidate", "--tracking-uri", uri]),
                       (ready.main, [str(config), "--check", "--tracking-uri", uri]),
                       (deploy.main, [str(config), "--pin-only", "--tracking-uri", uri])):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and f"server {uri} cannot be reached" in err[0], err
    os.environ["MLFLOW_TRACKING_URI"] = uri  # generate resolves models:/ against $MLFLOW_TRACKING_URI
    try:
        assert generate.main(["--model", f"models:/{MODEL}@champion", "--prompt", "x"]) == 2
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"server {uri} cannot be reached" in err[0], err


def test_a_server_that_is_not_mlflow_or_refuses_us_is_named(other_server, tmp_path, capsys):
    from efftx import promote
    from efftx.tracking import check_server

    status, uri = other_server
    with pytest.raises(LaunchError) as err:
        check_server(uri)
    if status == 404:
        assert f"{uri} answers but is not an MLflow tracking server (HTTP 404" in str(err.value)
    else:
        assert f"the MLflow tracking server {uri} refused the request (HTTP 401" in str(err.value)
        assert "MLFLOW_TRACKING_USERNAME" in str(err.value)
    assert promote.main([MODEL, "candidate", "--tracking-uri", uri]) == 2
    assert uri in capsys.readouterr().err


# ------------------------------------------------------------------ the server command

@pytest.fixture(scope="module")
def bucket(s3_server):
    return s3_server.create_bucket(BUCKET)


@pytest.fixture
def no_aws(monkeypatch):
    """This process holds no S3 credentials or endpoint: every artifact goes through the MLflow server. MLflow's
    retries are cut to one (a failing transfer fails the test in seconds, not after minutes of retries); what
    efftx.tracking sets process-wide (efftx.tracking.proxy_artifacts) is undone afterwards."""
    for key in list(os.environ):
        if key.startswith("AWS_") or key == "MLFLOW_S3_ENDPOINT_URL":
            monkeypatch.delenv(key)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    proxy_keys = ("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD")
    before = {k: os.environ.get(k) for k in proxy_keys}
    for key in proxy_keys:
        os.environ.pop(key, None)
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_server_command_bad_input_is_one_line_exit_2(s3_server, bucket, tmp_path):
    env = {**s3_server.env(), "EFFTX_HOME": str(tmp_path)}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _run(["-m", "efftx.tracking_server", "--port", str(port)], env)
        assert proc.returncode == 2 and f"error: cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    proc = _run(["-m", "efftx.tracking_server", "--port", str(free_port()),
                 "--artifacts-destination", "s3://no-such-bucket/mlartifacts"], env)
    assert proc.returncode == 2, proc.stderr
    assert ("error: --artifacts-destination=s3://no-such-bucket/mlartifacts: the bucket s3://no-such-bucket does not "
            f"exist (endpoint {s3_server.endpoint})") in proc.stderr
    proc = _run(["-m", "efftx.tracking_server", "--backend-store-uri", "sqlite:///rel.db"], env)
    assert proc.returncode == 2 and "--backend-store-uri='sqlite:///rel.db': give the sqlite file as an absolute path" \
        in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("mlflow-server*"))  # nothing started, nothing written


@pytest.fixture(scope="module")
def mlflow_server(s3_server, bucket, tmp_path_factory):
    """``python -m efftx.tracking_server`` as a user runs it: artifacts in the bucket, the backend store at its
    default (the efftx home's mlflow-server.db). Yields the tracking URI it printed."""
    port = free_port()
    log = tmp_path_factory.mktemp("mlflow-server") / "server.log"
    env = {**os.environ, **s3_server.env()}  # the server, and only the server, gets the store's credentials
    proc = subprocess.Popen([sys.executable, "-m", "efftx.tracking_server", "--port", str(port),
                             "--artifacts-destination", f"s3://{bucket}/mlartifacts", "--log", str(log),
                             "--workers", "1"],  # one server process: the tests share 2 cores
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    seen, uri = [], None
    while uri is None:
        try:
            line = lines.get(timeout=240)
        except queue.Empty:
            break
        seen.append(line)
        if line.startswith("train against it: --set tracking.uri="):
            uri = line.split("tracking.uri=", 1)[1].split()[0]
        if proc.poll() is not None and lines.empty():
            break
    if uri is None:
        proc.kill()
        pytest.fail("the MLflow server did not start:\n" + "".join(seen) + (log.read_text()[-4000:] if log.exists()
                                                                            else ""))
    assert uri == f"http://127.0.0.1:{port}"
    assert f"artifacts:     s3://{bucket}/mlartifacts (endpoint {s3_server.endpoint}), proxied" in "".join(seen)
    yield uri
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the command stops the server's whole process group
    assert proc.wait(timeout=60) == 0
    with pytest.raises(LaunchError):  # nothing answers any more
        from efftx.tracking import check_server

        check_server(uri, timeout=5)


def test_experiments_efftx_creates_on_the_server_keep_their_artifacts_in_the_bucket(mlflow_server, s3_server,
                                                                                     no_aws, tmp_path):
    from efftx.tracking import client_for, experiment_id

    client = client_for(mlflow_server)
    exp = experiment_id(client, "proxied", mlflow_server)
    assert client.get_experiment(exp).artifact_location.startswith("mlflow-artifacts:/")
    run = client.create_run(exp, run_name="proxied")
    client.log_text(run.info.run_id, "hello through the server", "notes/hello.txt")
    keys = s3_server.keys(BUCKET, "mlartifacts/")
    assert f"mlartifacts/{exp}/{run.info.run_id}/artifacts/notes/hello.txt" in keys
    # downloads go through the server too (never presigned URLs to the store): efftx.tracking.proxy_artifacts
    assert os.environ["MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD"] == "false"
    out = client.download_artifacts(run.info.run_id, "notes/hello.txt", str(tmp_path))
    assert Path(out).read_text() == "hello through the server"


# ------------------------------------------------------------------ a real run logging to the server

@pytest.mark.slow
def test_a_run_logs_to_the_server_registers_its_model_and_the_registry_works_over_http(
        ray_cluster, mlflow_server, s3_server, no_aws, tmp_path, capsys, monkeypatch):
    import mlflow.pyfunc
    from mlflow import MlflowClient

    from efftx import generate, promote
    from efftx.serving import deploy
    from efftx.train.launch import launch

    summary = launch(recipes.get("lm_debug").override({
        "name": "on-mlflow-server", "tracking.uri": mlflow_server, "tracking.model_name": MODEL,
        "train.steps": 10, "train.eval_every": 10, "train.checkpoint_every": 10, "train.log_every": 5,
        "scaling.num_workers": 1}))
    assert summary["final_step"] == 10 and summary["tracking_uri"] == mlflow_server
    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "10" and run.data.params["model.family"] == "lm"
    assert {"loss", "val_bpb", "tokens_per_s"} <= set(run.data.metrics)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_bpb")][-1] == 10
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")

    version = client.get_model_version_by_alias(MODEL, "candidate")
    assert version.run_id == run.info.run_id
    assert summary["registered_model"] == f"models:/{MODEL}/{version.version}"
    # the model's files are objects in the bucket, written there by the server
    assert version.source.startswith("mlflow-artifacts:/"), version.source  # the server's proxied store
    prefix = "mlartifacts/" + version.source[len("mlflow-artifacts:/"):].strip("/") + "/"
    keys = s3_server.keys(BUCKET, prefix)
    assert {prefix + "MLmodel", prefix + "artifacts/model.safetensors", prefix + "artifacts/config.json"} <= set(keys), \
        (version.source, keys)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # models:/ URIs resolve against it (generate too)
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@candidate")
    out = model.predict([{"prompt": "def ", "max_new_tokens": 8, "seed": 0}])
    assert len(out["text"][0]) > 0

    assert promote.main([MODEL, "candidate", "--tracking-uri", mlflow_server, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["action"] == "promoted" and result["version"] == str(version.version)
    assert client.get_model_version_by_alias(MODEL, "champion").version == version.version

    pinned, pins = deploy.pin({"applications": [{"name": "text", "import_path": "efftx.serving.text:build",
                                                  "args": {"target": f"models:/{MODEL}@champion"}}]}, mlflow_server)
    assert [p.pinned for p in pins] == [f"models:/{MODEL}/{version.version}"]
    assert pinned["applications"][0]["runtime_env"]["env_vars"]["MLFLOW_TRACKING_URI"] == mlflow_server

    assert generate.main(["--model", f"models:/{MODEL}@champion", "--prompt", "def ", "--max-new-tokens", "8",
                          "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
