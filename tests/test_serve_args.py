"""The text app's arguments (:class:`efftx.serving.app_args.TextAppArgs`), checked the ways Ray Serve passes them,
without starting Ray: ``serve run efftx.serving.text:build key=value ...`` (strings), ``serve run serve/text.yaml``
(a YAML mapping) and Python (a dict). The built application is read back without deploying it, as in
tests/test_serve_devices.py."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import get_args

import pytest
import yaml
from pydantic import ValidationError
from ray._common.utils import import_attr  # what `serve run` imports the builder with
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.build_app import build_app
from ray.serve.schema import ServeDeploySchema
from ray.serve.scripts import convert_args_to_dict

from efftx.serving import text
from efftx.serving.app_args import TextAppArgs
from efftx.serving.images import ImageLimits
from efftx.serving.schemas import Limits
from efftx.serving.text import build

YAML = Path(__file__).resolve().parents[1] / "serve" / "text.yaml"
TEXT_INIT = ("target", "draft", "name", "limits", "max_batch_size", "batch_wait_timeout_s", "images", "image_limits")


def serve_run(*cli_args: str):
    """What ``serve run efftx.serving.text:build ARG...`` does before it deploys: Ray Serve's own parsing of the
    ``key=value`` arguments and its builder call (which validates them against the builder's annotation)."""
    return call_user_app_builder_with_args_if_necessary(import_attr("efftx.serving.text:build"),
                                                        convert_args_to_dict(cli_args))


def bound(app) -> dict:
    """{name: (init args by name, init kwargs, ray_actor_options)} of a built app's deployments (the text one's
    ``images`` argument, the bound image deployment, read as whether there is one)."""
    textdep = app._bound_deployment
    init = dict(zip(TEXT_INIT, textdep.init_args))
    images, init["images"] = init["images"], init["images"] is not None
    out = {"TextGenerator": (init, textdep.init_kwargs, textdep.ray_actor_options)}
    if images is not None:
        img = images._bound_deployment
        out["ImageGenerator"] = (dict(zip(("model", "max_batch_size", "batch_wait_timeout_s"), img.init_args)),
                                 img.init_kwargs, img.ray_actor_options)
    return out


def named(argument: str, message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for pydantic's report of a bad ``argument`` (its dotted location on a
    line of its own, then the message)."""
    return rf"(?m)^{re.escape(argument)}\n  {re.escape(message)}"


# ================================================================================ the command line
def test_serve_run_converts_the_command_lines_strings_to_typed_arguments():
    app = serve_run("target=/nowhere/target", "draft=/nowhere/draft", "name=tiny", "max_batch_size=16",
                    "batch_wait_timeout_s=0.5", 'limits={"max_new_tokens": 64, "max_temperature": "1.5"}',
                    "num_gpus=0.5", "dalle=/nowhere/dalle", "image_max_batch_size=4",
                    "image_batch_wait_timeout_s=0.1", 'image_limits={"max_images": 2}', "batching=STATIC")
    deps = bound(app)
    init, kwargs, options = deps["TextGenerator"]
    assert init["target"] == "/nowhere/target" and init["draft"] == "/nowhere/draft" and init["name"] == "tiny"
    assert init["max_batch_size"] == 16 and type(init["max_batch_size"]) is int
    assert init["batch_wait_timeout_s"] == 0.5 and type(init["batch_wait_timeout_s"]) is float
    assert init["limits"] == {**vars(Limits()), "max_new_tokens": 64, "max_temperature": 1.5}
    assert init["image_limits"] == ImageLimits(max_images=2).model_dump()
    assert kwargs == {"device": "auto", "batching": "static"}  # normalized
    assert options["num_gpus"] == 0.5
    init, kwargs, options = deps["ImageGenerator"]
    assert init == {"model": "/nowhere/dalle", "max_batch_size": 4, "batch_wait_timeout_s": 0.1}
    assert type(init["max_batch_size"]) is int and "num_gpus" not in options
    # and Serve's own build step (what `serve run` deploys) takes the app
    assert sorted(d.name for d in build_app(app, name="text").deployments) == ["ImageGenerator", "TextGenerator"]


def test_the_builder_is_what_serve_calls():
    """Ray Serve calls a builder that has exactly one parameter, and converts the arguments only when that
    parameter is annotated with a pydantic model (ray/serve/_private/api.py)."""
    (param,) = inspect.signature(build).parameters.values()
    assert param.annotation is TextAppArgs


def test_an_unknown_argument_is_refused_by_name():
    with pytest.raises(ValidationError, match=named("max_batch", "Extra inputs are not permitted")):
        serve_run("target=/nowhere/target", "max_batch=16")
    with pytest.raises(ValueError, match=named("bogus", "Extra inputs are not permitted")):
        build({"target": "/nowhere/target", "bogus": ""})  # even empty
    with pytest.raises(ValueError, match=named("limits.max_tokens", "Unexpected keyword argument")):
        serve_run("target=/nowhere/target", 'limits={"max_tokens": 64}')
    with pytest.raises(ValueError, match=named("image_limits.images", "Extra inputs are not permitted")):
        build({"target": "/nowhere/target", "image_limits": {"images": 2}})


def test_the_target_is_required():
    with pytest.raises(ValidationError, match=named("target", "Field required")):
        serve_run("draft=/nowhere/draft")


@pytest.mark.parametrize("argument, value, message", [
    ("batching", "dynamic", "Input should be 'continuous' or 'static'"),
    ("device", "tpu", "Input should be 'auto', 'cpu' or 'cuda'"),
    ("max_batch_size", "0", "Input should be greater than 0"),
    ("max_batch_size", "2.5", "Input should be a valid integer"),
    ("batch_wait_timeout_s", "-1", "Input should be greater than or equal to 0"),
    ("batch_wait_timeout_s", "inf", "Input should be a finite number"),
    ("num_gpus", "lots", "Input should be a valid number"),
    ("image_num_gpus", "-0.5", "Input should be greater than or equal to 0"),
    ("image_max_batch_size", "0", "Input should be greater than 0"),
    ("image_batch_wait_timeout_s", "nan", "Input should be a finite number"),
    ("limits", "{max_new_tokens: 64}", "Value error, not a JSON object"),
    ("limits", "[64]", "Input should be a dictionary or an instance of Limits"),
    ("limits.max_new_tokens", '{"max_new_tokens": "many"}', "Input should be a valid integer"),
    ("image_limits", "{", "Value error, not a JSON object"),
])
def test_a_bad_value_is_refused_naming_its_argument(argument, value, message):
    with pytest.raises(ValidationError, match=named(argument, message)):
        serve_run("target=/nowhere/target", f"{argument.split('.')[0]}={value}")


# ================================================================================ defaults
def test_defaults_follow_the_batching_mode():
    init, kwargs, _ = bound(build({"target": "/nowhere/target"}))["TextGenerator"]
    assert (init["max_batch_size"], init["batch_wait_timeout_s"], kwargs["batching"]) == (32, 0.0, "continuous")
    assert init["draft"] is None and init["name"] is None and not init["images"]
    assert init["limits"] is None and init["image_limits"] is None  # the deployments' own defaults
    init, kwargs, _ = bound(build({"target": "/nowhere/target", "batching": "static"}))["TextGenerator"]
    assert (init["max_batch_size"], init["batch_wait_timeout_s"], kwargs["batching"]) == (8, 0.02, "static")
    init, _, _ = bound(build({"target": "/nowhere/target", "batching": "static", "max_batch_size": 3}))["TextGenerator"]
    assert (init["max_batch_size"], init["batch_wait_timeout_s"]) == (3, 0.02)


def test_warm_up_rows_reach_the_replica_and_need_continuous_batching():
    _, kwargs, _ = bound(build({"target": "/nowhere/target", "warm_up_rows": "4"}))["TextGenerator"]
    assert kwargs["warm_up_rows"] == 4 and type(kwargs["warm_up_rows"]) is int
    _, kwargs, _ = bound(build({"target": "/nowhere/target"}))["TextGenerator"]
    assert "warm_up_rows" not in kwargs  # the replica's own default
    with pytest.raises(ValidationError, match="warm_up_rows: only with batching=continuous"):
        build({"target": "/nowhere/target", "batching": "static", "warm_up_rows": 4})
    with pytest.raises(ValidationError, match="warm_up_rows"):
        build({"target": "/nowhere/target", "warm_up_rows": -1})


def test_threads_and_cpus_reach_the_replica():
    """``threads``: the replica's torch threads (a constructor argument); ``num_cpus``: its Ray CPU share."""
    init, kwargs, options = bound(serve_run("target=/nowhere/target", "threads=4", "num_cpus=4"))["TextGenerator"]
    assert kwargs["threads"] == 4 and type(kwargs["threads"]) is int and options["num_cpus"] == 4
    _, kwargs, options = bound(build({"target": "/nowhere/target", "batching": "static"}))["TextGenerator"]
    assert "threads" not in kwargs and options["num_cpus"] == 0.25  # the replica's and the deployment's defaults
    _, _, options = bound(build({"target": "/nowhere/target", "num_cpus": 2, "num_gpus": 0.5}))["TextGenerator"]
    assert (options["num_cpus"], options["num_gpus"]) == (2, 0.5)
    for argument, value in (("threads", 0), ("threads", 1.5), ("num_cpus", 0)):
        with pytest.raises(ValidationError, match=argument):
            build({"target": "/nowhere/target", argument: value})


def test_compile_settings_reach_the_replica_and_need_continuous_batching():
    """``compile`` / ``compile_rows``: the scheduler's compiled passes (constructor arguments); the default row
    limit is filled in by the replica (``device_slots.compile_knobs``): none, or a few rows on a CPU without the
    decode attention kernel."""
    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "compile=AUTO", "compile_rows=8"))["TextGenerator"]
    assert (kwargs["compile"], kwargs["compile_rows"]) == ("auto", 8) and type(kwargs["compile_rows"]) is int
    _, kwargs, _ = bound(build({"target": "/nowhere/target"}))["TextGenerator"]
    assert "compile" not in kwargs and "compile_rows" not in kwargs
    for bad, message in (({"compile": "fast"}, "compile"), ({"compile_rows": 0, "compile": "on"}, "compile_rows"),
                         ({"compile_rows": 4}, "compile_rows: only with compile=on or compile=auto"),
                         ({"compile": "on", "batching": "static"}, "compile: only with batching=continuous")):
        with pytest.raises(ValidationError, match=message):
            build({"target": "/nowhere/target", **bad})
    import torch

    from efftx.generation import device_slots
    from efftx.generation.device_slots import CPU_COMPILE_ROWS, compile_knobs

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert compile_knobs("off", None, cpu) == {"compile": "off"}
    # a CPU with the decode attention kernel (built here): every pass compiled; without it, a few rows
    assert device_slots.decode_attention_cpu.kernel() is not None
    assert compile_knobs("auto", None, cpu) == {"compile": "auto"}
    real = device_slots.decode_attention_cpu.kernel
    device_slots.decode_attention_cpu.kernel = lambda: None
    try:
        assert compile_knobs("auto", None, cpu) == {"compile": "auto", "compile_rows": CPU_COMPILE_ROWS}
    finally:
        device_slots.decode_attention_cpu.kernel = real
    assert compile_knobs("on", None, gpu) == {"compile": "on"}  # every pass compiled
    assert compile_knobs("on", 4, gpu) == {"compile": "on", "compile_rows": 4}


def test_prefill_chunk_reaches_the_scheduler_and_needs_continuous_batching():
    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "prefill_chunk=64"))["TextGenerator"]
    assert kwargs["priority"] == {"prefill_chunk": 64}
    for bad, message in (({"prefill_chunk": -1}, named("prefill_chunk", "Input should be greater than or equal to 0")),
                         ({"prefill_chunk": 64, "batching": "static"}, "prefill_chunk: only with batching=continuous")):
        with pytest.raises(ValidationError, match=message):
            build({"target": "/nowhere/target", **bad})


def test_steps_per_round_reaches_the_scheduler_and_needs_continuous_batching():
    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "steps_per_round=4"))["TextGenerator"]
    assert kwargs["priority"] == {"steps_per_round": 4}
    for bad, message in (({"steps_per_round": 0}, named("steps_per_round", "Input should be greater than 0")),
                         ({"steps_per_round": "many"}, named("steps_per_round", "Input should be a valid integer")),
                         ({"steps_per_round": 4, "batching": "static"},
                          "steps_per_round: only with batching=continuous")):
        with pytest.raises(ValidationError, match=message):
            build({"target": "/nowhere/target", **bad})


def test_pipeline_reaches_the_scheduler_and_needs_continuous_batching():
    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "pipeline=true"))["TextGenerator"]
    assert kwargs["priority"] == {"pipeline": True}
    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "pipeline=false"))["TextGenerator"]
    assert kwargs["priority"] == {"pipeline": False}
    for bad, message in (({"pipeline": "sometimes"}, named("pipeline", "Input should be a valid boolean")),
                         ({"pipeline": True, "batching": "static"}, "pipeline: only with batching=continuous")):
        with pytest.raises(ValidationError, match=message):
            build({"target": "/nowhere/target", **bad})


def test_cache_memory_settings_reach_the_replica_and_resolve_to_bytes():
    """``cache_mib`` / ``cache_fraction``: the decoding caches' budget (constructor arguments), one of them, with
    continuous batching; the replica turns them into bytes of its device's memory."""
    import os

    import torch

    from efftx.serving.devices import cache_budget

    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "cache_mib=1.5"))["TextGenerator"]
    assert kwargs["cache_mib"] == 1.5 and "cache_fraction" not in kwargs
    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "cache_fraction=0.25"))["TextGenerator"]
    assert kwargs["cache_fraction"] == 0.25 and "cache_mib" not in kwargs
    _, kwargs, _ = bound(build({"target": "/nowhere/target"}))["TextGenerator"]
    assert "cache_mib" not in kwargs and "cache_fraction" not in kwargs
    for bad, message in (({"cache_mib": 0}, named("cache_mib", "Input should be greater than 0")),
                         ({"cache_fraction": 1.5}, named("cache_fraction", "Input should be less than or equal to 1")),
                         ({"cache_mib": 8, "cache_fraction": 0.5}, "give one of them"),
                         ({"cache_mib": 8, "batching": "static"}, "cache_mib: only with batching=continuous")):
        with pytest.raises(ValidationError, match=message):
            build({"target": "/nowhere/target", **bad})
    cpu = torch.device("cpu")
    assert cache_budget(None, None, cpu) is None
    assert cache_budget(1.5, None, cpu) == 3 * 2**19
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cache_budget(None, 0.25, cpu) == int(ram / 4)  # on a CPU: a share of the machine's memory
    with pytest.raises(ValueError, match="cache_fraction must be in"):
        cache_budget(None, 0, cpu)


def test_cache_fraction_on_a_gpu_is_of_the_replicas_share_of_it(monkeypatch, ray_cluster):
    """On a GPU ``cache_fraction`` is of the replica's part of the GPU's memory (its ``num_gpus``, up to the whole
    GPU): two replicas of half a GPU and ``cache_fraction=0.5`` hold a quarter each, not half each (all of it).
    The GPU is faked (its properties), and so is the share Ray assigns (no GPU in this cluster); the Ray call that
    reads it runs for real in a task given none. Power: with the share ignored (as before), the 0.5 share reads
    40 GiB where 20 is due."""
    from types import SimpleNamespace

    import ray
    import torch

    from efftx.serving.devices import cache_budget, replica_gpu_share

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * gib))
    gpu = torch.device("cuda", 0)
    assert cache_budget(None, 0.5, gpu, 0.5) == 20 * gib
    assert cache_budget(None, 0.5, gpu, 0.25) == 10 * gib
    for whole in (None, 1, 2):  # no share known, one GPU, or more than one: the fraction is of the whole GPU
        assert cache_budget(None, 0.5, gpu, whole) == 40 * gib
    assert cache_budget(8, None, gpu, 0.5) == 8 * 2**20  # MiB are MiB, whatever the share
    with pytest.raises(ValueError, match="gpu_share must be >= 0"):
        cache_budget(None, 0.5, gpu, -1)
    cpu = torch.device("cpu")
    assert cache_budget(None, 0.5, cpu, 0.5) == cache_budget(None, 0.5, cpu)  # a CPU: the machine's memory

    # what Ray reserved: none for a task given no GPU (the real call), the fraction for one given a share (faked)
    assert ray.get(ray.remote(num_cpus=0.01)(replica_gpu_share).remote()) is None

    class Context:
        def get_assigned_resources(self):
            return {"CPU": 0.25, "GPU": 0.5}

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    assert replica_gpu_share() == 0.5


def test_a_compiled_replica_warms_up_every_bucket_it_compiles():
    size = text.warm_up_size
    assert size(16, 32, {"compile": "off"}) == 16 and size(16, 8, {"compile": "off"}) == 8
    assert size(16, 32, {"compile": "on"}) == 32  # a GPU: every pass compiled, up to the batch's rows
    assert size(16, 32, {"compile": "auto", "compile_rows": 2}) == 16 and size(1, 32, {"compile": "on",
                                                                                       "compile_rows": 4}) == 4
    assert size(0, 32, {"compile": "on"}) == 0  # no warm-up asked for: none


def test_an_empty_value_means_not_given():
    """``draft: ""`` or ``batching:`` with no value in YAML: the default, as before."""
    app = build({"target": "/nowhere/target", "draft": "", "dalle": " ", "batching": None, "max_batch_size": "",
                 "limits": "", "num_gpus": ""})
    init, kwargs, options = bound(app)["TextGenerator"]
    assert init["draft"] is None and not init["images"] and init["limits"] is None
    assert (init["max_batch_size"], kwargs["batching"]) == (32, "continuous") and "num_gpus" not in options


def test_a_model_instance_and_its_dict_build_the_same_app():
    args = TextAppArgs(target="/nowhere/target", dalle="/nowhere/dalle", max_batch_size=4, limits=Limits(max_gamma=4))
    assert bound(build(args)) == bound(build(args.model_dump(exclude_unset=True) | {"limits": {"max_gamma": 4}}))


def test_the_engine_reaches_the_replica_and_needs_continuous_batching():
    _, kwargs, _ = bound(serve_run("target=/nowhere/target", "engine=process"))["TextGenerator"]
    assert kwargs["engine"] == "process"
    _, kwargs, _ = bound(serve_run("target=/nowhere/target"))["TextGenerator"]
    assert "engine" not in kwargs  # the replica's default: a thread
    for bad, message in (({"engine": "fork"}, named("engine", "Input should be 'thread' or 'process'")),
                         ({"engine": "process", "batching": "static"}, "engine: only with batching=continuous")):
        with pytest.raises(ValidationError, match=message):
            build({"target": "/nowhere/target", **bad})


def test_the_model_matches_the_deployment_and_documents_every_argument():
    assert get_args(TextAppArgs.model_fields["batching"].annotation) == text.BATCHING
    assert get_args(TextAppArgs.model_fields["engine"].annotation.__args__[0]) == text.ENGINES
    undocumented = [name for name, field in TextAppArgs.model_fields.items() if not field.description]
    assert not undocumented


# ================================================================================ the YAML config
def test_the_yaml_config_builds_as_serve_builds_it():
    config = ServeDeploySchema.model_validate(yaml.safe_load(YAML.read_text()))  # how `serve run FILE` reads it
    (application,) = config.applications
    app = call_user_app_builder_with_args_if_necessary(import_attr(application.import_path), application.args)
    init, kwargs, _ = bound(app)["TextGenerator"]
    assert init["target"] == "models:/spec_target_small@champion" and kwargs["batching"] == "continuous"
    assert init["images"]


def test_the_yaml_configs_commented_out_arguments_are_valid_too():
    """The config's commented-out examples (``# num_gpus: 0.5``, the limits) are arguments the model takes."""
    out, depth = [], 0  # depth: the braces a flow mapping spread over comment lines has left open
    for line in YAML.read_text().splitlines():
        m = re.match(r"^      # (\w+): ", line)
        if (m and m.group(1) in TextAppArgs.model_fields) or (depth > 0 and line.startswith("      # ")):
            line = "      " + line[len("      # "):]
            depth += line.count("{") - line.count("}")
        out.append(line)
    args = yaml.safe_load("\n".join(out))["applications"][0]["args"]
    uncommented = {"num_gpus", "image_num_gpus", "device", "threads", "num_cpus", "compile", "compile_rows", "limits",
                   "image_limits"}
    assert uncommented <= set(args)
    checked = TextAppArgs.model_validate(args)
    assert checked.limits == Limits() and checked.image_limits == ImageLimits()  # "these are the defaults"
