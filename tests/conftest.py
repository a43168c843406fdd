"""Test fixtures: an isolated efftx home, and one local Ray cluster per test session."""

from __future__ import annotations

import os
import tempfile

# Before anything imports efftx: all runs, MLflow records and corpus caches go to a throwaway home.
os.environ["EFFTX_HOME"] = tempfile.mkdtemp(prefix="efftx-test-home-")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train's controller polls its workers every 2 s by default: every phase of every short test run (start,
# reports, the end) waits for a poll. 0.5 s keeps the same behaviour with less idle time per run.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray 2.60 turns token authentication on for a new local cluster and, without a token, writes one to
# ~/.ray/auth_token. The tests bring their own (a throwaway file made as `make cluster-up` makes one), so they
# neither read nor write ~/.ray: what passes here passes on a machine that never ran Ray.
for _key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
    os.environ.pop(_key, None)
os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(tempfile.mkdtemp(prefix="efftx-test-ray-"), "auth_token")
os.environ["RAY_AUTH_MODE"] = "token"
from efftx.cluster import ensure_token  # noqa: E402  (imports nothing of Ray)

ensure_token()
# Triton kernels (efftx.kernels) run on CPU tensors through Triton's interpreter, which is chosen when a kernel
# is decorated, i.e. when efftx.kernels is imported: it must be on before that. A CUDA machine runs the compiled
# kernels on the GPU instead with EFFTX_TRITON_GPU=1 (tests/test_kernels.py then uses cuda tensors and bf16 too).
if os.environ.get("EFFTX_TRITON_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


# Seconds the slowest test files took here (2 cores, `make test`, a cold torch.compile cache as in CI), a scheduling
# hint only: in a pytest-xdist worker (`make test`: -n 2 --dist loadfile --no-loadscope-reorder hands out files in
# collection order, each to the first free process) files go out longest first, so that the two processes end
# together instead of one running a long file alone at the end; a file not listed counts 0 (after these, in their
# usual order).
FILE_SECONDS = {"test_train_ray.py": 255, "test_multinode.py": 250, "test_serve_compiled.py": 190,
                "test_resume_cluster.py": 105, "test_resume_exact.py": 100, "test_serve_isolation.py": 95,
                "test_dalle_train.py": 90, "test_decode_attention.py": 90, "test_nsa.py": 90, "test_job_submit.py": 85,
                "test_serve_load_bench.py": 80, "test_distill.py": 80, "test_tune.py": 80, "test_storage_uri.py": 70,
                "test_tune_search.py": 70, "test_serve_redeploy.py": 60, "test_tokenizer_lm.py": 60,
                "test_image_streaming.py": 50, "test_gpu_check.py": 50, "test_kernels.py": 45,
                "test_tracking_server.py": 40, "test_speculative.py": 35, "test_serve.py": 100,
                "test_learning_parity.py": 30, "test_data_handoff.py": 30,
                "test_serve_engine_process.py": 30, "test_serve_ingress.py": 35}


def pytest_collection_modifyitems(config, items):
    """One process (``pytest``): tests that start their own Ray cluster run first, before the session's cluster
    exists. A pytest-xdist worker (its own session cluster, started by the first test that asks for one, beside which
    those tests also pass): the longest files first (FILE_SECONDS)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's tests keep their order
    else:
        items.sort(key=lambda item: 0 if item.get_closest_marker("own_cluster") else 1)


@pytest.fixture(scope="session")
def ray_cluster():
    """One in-process Ray cluster for the session (Ray 2.60 has no local_mode)."""
    import ray

    from efftx.cluster import start_local
    from netutil import free_port

    # a free dashboard port: two test processes (pytest -n 2) each run a cluster of their own
    # start_local: always a new cluster of its own (never one a `ray start` on this machine left in
    # /tmp/ray/ray_current_cluster), whose workers know its address, so Ray Train frees the placement group of a
    # Tune trial that ASHA stopped even with the other test process's cluster beside it (tests/test_tune.py)
    yield start_local(num_cpus=4, include_dashboard=True, dashboard_port=free_port(), log_to_driver=True)
    ray.shutdown()


@pytest.fixture(scope="session")
def efftx_home() -> str:
    return os.environ["EFFTX_HOME"]


@pytest.fixture(scope="session")
def debug_exports(tmp_path_factory) -> dict[str, str]:
    """Export folders of untrained debug models for the Serve tests: the speculative pair (``target``,
    ``draft``) and a DALL-E over byte captions (``dalle``)."""
    import torch

    from efftx import recipes
    from efftx.models import build as build_model
    from efftx.export import export

    root = tmp_path_factory.mktemp("exports")
    paths = {}
    for role, seed in (("target", 0), ("draft", 1)):
        cfg = recipes.get(f"spec_{role}_debug")
        torch.manual_seed(seed)
        paths[role] = str(export(build_model(cfg), cfg, root / role, {}))
    cfg = recipes.get("dalle_shapes_debug").override({"model.vocab_size": 257})  # the byte tokenizer's ids
    torch.manual_seed(2)
    paths["dalle"] = str(export(build_model(cfg), cfg, root / "dalle", {}))
    return paths


@pytest.fixture
def break_compile(monkeypatch):
    """``break_compile()``: efftx.generation.compiled's factory (``compiled_function``) then builds steps that fail
    as a missing C++ compiler makes torch.compile fail, and no earlier failure is remembered."""
    from efftx.generation import compiled

    def factory(fn, device_type):
        def step(*args):
            raise RuntimeError("no C++ compiler")
        return step

    def apply() -> None:
        monkeypatch.setattr(compiled, "compiled_function", factory)
        monkeypatch.setattr(compiled, "_BROKEN", {})

    return apply


@pytest.fixture
def one_thread():
    """Tiny models: one torch thread is faster than two fighting over a shared 2-core CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's standalone server, tests/s3server.py) on 127.0.0.1 for the session."""
    import s3server

    server = s3server.start()
    yield server
    server.stop()
