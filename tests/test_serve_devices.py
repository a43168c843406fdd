"""Serving on GPUs, checked on a CPU machine (fast, no Ray started): the builder's ``num_gpus`` /
``image_num_gpus`` / ``device`` arguments, read back from the bound application without deploying it, and the
replica's device choice. (``/models/info`` naming the device is checked over HTTP in tests/test_serve.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from efftx.serving import devices
from efftx.serving.devices import replica_device, resolve_build_devices
from efftx.serving.text import build


def deployments(app) -> dict:
    """{name: bound deployment} of a built app, without starting it (``Application._bound_deployment`` is what
    Serve's own ``build_app`` reads; the image deployment is an argument of the text one)."""
    text = app._bound_deployment
    out = {text.name: text}
    for arg in text.init_args:
        if hasattr(arg, "_bound_deployment"):
            out[arg._bound_deployment.name] = arg._bound_deployment
    return out


ARGS = {"target": "/nowhere/target", "draft": "/nowhere/draft", "dalle": "/nowhere/dalle"}


def named(argument: str, message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for pydantic's report of a bad ``argument``: its name on a line of
    its own, then the message."""
    return rf"(?m)^{re.escape(argument)}\n  {re.escape(message)}"


def test_gpu_shares_go_into_each_deployments_ray_actor_options():
    deps = deployments(build({**ARGS, "num_gpus": "0.5", "image_num_gpus": 0.25}))
    assert deps["TextGenerator"].ray_actor_options == {"num_cpus": 0.25, "num_gpus": 0.5}
    assert deps["ImageGenerator"].ray_actor_options == {"num_cpus": 0.25, "num_gpus": 0.25}
    assert deps["TextGenerator"].init_kwargs["device"] == deps["ImageGenerator"].init_kwargs["device"] == "auto"
    deps = deployments(build({**ARGS, "num_gpus": 1, "device": "cpu"}))  # whole GPUs too; the image side asks none
    assert deps["TextGenerator"].ray_actor_options["num_gpus"] == 1.0
    assert "num_gpus" not in deps["ImageGenerator"].ray_actor_options
    assert deps["TextGenerator"].init_kwargs["device"] == "cpu"


def test_without_gpu_arguments_nothing_changes():
    deps = deployments(build(ARGS))
    for dep in deps.values():
        assert dep.ray_actor_options == {"num_cpus": 0.25} and dep.init_kwargs["device"] == "auto"
    assert deps["TextGenerator"].init_kwargs["batching"] == "continuous"


def test_device_cuda_without_cuda_is_a_build_error_naming_the_argument(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device=cuda.*no CUDA device"):
        build({**ARGS, "device": "cuda"})
    # bad values are refused by the arguments' model (efftx.serving.app_args.TextAppArgs): pydantic's message
    # names the argument on its own line, then says what is wrong with it
    with pytest.raises(ValueError, match=named("device", "Input should be 'auto', 'cpu' or 'cuda'")):
        build({**ARGS, "device": "tpu"})
    for value, why in (("lots", "a valid number"), ("-1", "greater than or equal to 0"), ("nan", "a finite number")):
        with pytest.raises(ValueError, match=named("num_gpus", f"Input should be {why}")):
            build({**ARGS, "num_gpus": value})
    with pytest.raises(ValueError, match=named("image_num_gpus", "Input should be greater than or equal to 0")):
        build({**ARGS, "image_num_gpus": "-0.5"})
    with pytest.raises(ValueError, match=named("batching", "Input should be 'continuous' or 'static'")):
        build({**ARGS, "batching": "dynamic"})


def test_device_cuda_with_a_gpu_in_sight_asks_for_gpu_shares(monkeypatch):
    monkeypatch.setattr(devices, "cuda_in_sight", lambda: True)
    deps = deployments(build({**ARGS, "device": "cuda"}))  # as bench/gpu_check.py builds it: half a GPU each
    assert deps["TextGenerator"].ray_actor_options["num_gpus"] == 0.5
    assert deps["ImageGenerator"].ray_actor_options["num_gpus"] == 0.5
    assert deps["TextGenerator"].init_kwargs["device"] == "cuda"
    assert resolve_build_devices("cuda", "1", None) == ("cuda", 1.0, 0.5)
    with pytest.raises(ValueError, match="device=cuda with num_gpus=0"):
        build({**ARGS, "device": "cuda", "num_gpus": 0})


def test_the_replica_device():
    assert replica_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert replica_device("auto") == torch.device("cpu")  # no GPU given (and none to use)
        with pytest.raises(RuntimeError, match="device=cuda"):
            replica_device("cuda")


def test_a_streams_steps_run_on_the_replicas_threads_in_any_pool_thread():
    """Starlette runs each step of a sync stream in whichever thread of its pool is free, a new thread starting with
    the process default (both cores here): ``with_threads`` sets the replica's count before every step, so a
    1-thread replica's stream decodes on one core; a plain iterator does not."""
    import concurrent.futures

    from cores import cores_used, needs_two_cores

    needs_two_cores()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the replica's setting, made in its own thread
    try:
        def steps():
            for _ in range(2):
                yield cores_used()

        for wrapped, one_core in ((devices.with_threads(steps(), 1), True), (steps(), False)):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # fresh threads, as Starlette's pool has
                used = [pool.submit(next, wrapped).result() for _ in range(2)]
            assert all(u < 1.3 for u in used) if one_core else all(u > 1.3 for u in used), used
        assert list(devices.with_threads(iter(()), 1)) == []
    finally:
        torch.set_num_threads(before)
