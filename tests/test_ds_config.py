"""Bringing your own DeepSpeed config (engine.deepspeed_config / --deepspeed-config): the merge rule (the file
wins and lands in the run config), its errors, DeepSpeed's optimizers by name, and the WarmupLR / WarmupDecayLR
schedules, step for step against DeepSpeed's own scheduler classes. No Ray."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from efftx import recipes
from efftx.cli import train_main
from efftx.errors import ConfigError
from efftx.train import engine as engine_lib
from efftx.train.engine import Schedule, deepspeed_config, lr_lambda
from efftx.train.launch import resolve

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ds_config_performer_enwik8.json"


def resolved(tmp_path, ds: dict | str, recipe: str = "lm_debug", **overrides):
    """The lm_debug run (2 workers, micro batch 4, accumulation 2) resolved with ``ds`` as its DeepSpeed config."""
    file = tmp_path / "ds.json"
    file.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    cfg = recipes.get(recipe).override({"name": "t", "engine.deepspeed_config": str(file), **overrides})
    return resolve(cfg)


# ------------------------------------------------------------------------------------------------ merge rule

@pytest.mark.parametrize("ds, expected", [
    ({"train_micro_batch_size_per_gpu": 3}, {"train.micro_batch_size": 3, "train.grad_accum": 2}),
    ({"gradient_accumulation_steps": 5}, {"train.grad_accum": 5, "train.micro_batch_size": 4}),
    ({"train_batch_size": 24}, {"train.micro_batch_size": 6, "train.grad_accum": 2}),  # 24 / (2 x 2 workers)
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, {"train.grad_accum": 3}),  # DeepSpeed's rule
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 6},
     {"train.micro_batch_size": 2, "train.grad_accum": 6}),
    ({"gradient_clipping": 0.25}, {"train.grad_clip": 0.25}),
    ({"max_grad_norm": 0.5}, {"train.grad_clip": 0.5}),  # the original examples' (legacy) name
    ({"gradient_clipping": 0}, {"train.grad_clip": 0.0}),
    ({"bf16": {"enabled": True}}, {"engine.precision": "bf16"}),
    ({"bfloat16": {"enabled": True}}, {"engine.precision": "bf16"}),
    ({"fp16": {"enabled": False}}, {"engine.precision": "fp32"}),
    ({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500}},
     {"engine.precision": "fp16", "engine.initial_scale_power": 12, "engine.loss_scale_window": 500}),
    ({"zero_optimization": {"stage": 2}}, {"engine.zero_stage": 2, "engine.offload_optimizer": "none"}),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
     {"engine.zero_stage": 2, "engine.offload_optimizer": "cpu", "engine.offload_param": "none"}),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
     {"engine.zero_stage": 3, "engine.offload_optimizer": "cpu", "engine.offload_param": "cpu"}),
    ({"zero_optimization": False}, {"engine.zero_stage": 0}),
    ({"zero_optimization": True}, {"engine.zero_stage": 1}),  # DeepSpeed's legacy boolean form
    ({"optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.8, 0.999], "eps": 1e-6,
                                               "weight_decay": 0.01, "adam_w_mode": False}}},
     {"engine.optimizer": "adam", "train.lr": 2e-4, "train.beta1": 0.8, "train.beta2": 0.999, "train.eps": 1e-6,
      "train.weight_decay": 0.01}),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}},  # DeepSpeed's Adam: adam_w_mode defaults to true
     {"engine.optimizer": "adamw", "train.lr": 1e-4, "train.beta1": 0.9, "train.beta2": 0.999, "train.eps": 1e-8,
      "train.weight_decay": 0.0}),  # missing params: DeepSpeed's defaults, not the recipe's (0.95, 0.1)
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.05}}},
     {"engine.optimizer": "adamw", "train.lr": 1e-3, "train.weight_decay": 0.05}),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, {"engine.optimizer": "lamb"}),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10}}},
     {"train.schedule": "warmup", "train.lr": 1e-3, "train.warmup_steps": 10, "train.warmup_type": "log",
      "train.warmup_min_lr": 0.0}),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 5, "warmup_type": "linear",
                                                        "total_num_steps": 30}}},
     {"train.schedule": "warmup_decay", "train.lr": 1e-3, "train.warmup_min_lr": 1e-5, "train.warmup_steps": 5,
      "train.warmup_type": "linear", "train.steps": 30}),
    # WarmupLR without warmup_max_lr warms up to the optimizer's lr (the file's, else the run's)
    ({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}, "scheduler": {"type": "WarmupLR",
                                                                            "params": {"warmup_num_steps": 4}}},
     {"train.lr": 5e-4, "train.warmup_steps": 4}),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}, {"train.lr": 3e-3}),
    # the scheduler's max lr wins over the optimizer's, as under DeepSpeed
    ({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 1e-3, "warmup_num_steps": 4}}}, {"train.lr": 1e-3}),
    ({"steps_per_print": 10, "wall_clock_breakdown": False}, {"train.grad_clip": 1.0}),  # accepted, ignored
])
def test_each_deepspeed_key_lands_in_the_run_config(tmp_path, ds, expected):
    cfg = resolved(tmp_path, ds)
    got = {key: cfg.get(key) for key in expected}
    assert got == pytest.approx(expected) if all(isinstance(v, float) for v in expected.values()) else got == expected


def test_the_file_wins_over_set_and_keys_it_lacks_stay(tmp_path):
    cfg = resolved(tmp_path, {"gradient_clipping": 0.3}, **{"train.grad_clip": 2.0, "train.lr": 0.01})
    assert cfg.train.grad_clip == 0.3  # the file's, over --set
    assert cfg.train.lr == 0.01 and cfg.engine.optimizer == "torch_adamw" and cfg.train.schedule == "cosine"


def test_resolving_twice_is_the_same_and_the_path_is_absolute_and_resumable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"gradient_clipping": 0.3}))
    cfg = recipes.get("lm_debug").override({"name": "t", "engine.deepspeed_config": "ds.json"})
    once = resolve(cfg)
    assert once.engine.deepspeed_config == str(tmp_path / "ds.json")
    assert resolve(once).to_dict() == once.to_dict()
    assert once.resumable("engine.deepspeed_config")  # its values are what the resume check compares


def test_performer_example_file_resolves_from_the_command_line(capsys):
    code = train_main(["--recipe", "performer_enwik8", "--workers", "2", "--run-name", "x",
                       "--deepspeed-config", str(EXAMPLE), "--print-config"])
    assert code == 0
    cfg = json.loads(capsys.readouterr().out)
    t, e = cfg["train"], cfg["engine"]
    assert (t["micro_batch_size"], t["grad_accum"]) == (4, 4)  # 32 / (4 x 2 workers)
    assert t["grad_clip"] == 0.5 and t["lr"] == 2e-4
    assert (t["beta1"], t["beta2"], t["eps"]) == (0.8, 0.999, 1e-8)
    assert (t["schedule"], t["warmup_steps"], t["warmup_type"], t["warmup_min_lr"]) == ("warmup", 1000, "log", 0.0)
    assert t["weight_decay"] == 0.0  # DeepSpeed's Adam default, not the recipe's 0.1
    assert (e["precision"], e["zero_stage"], e["optimizer"]) == ("fp32", 0, "adamw")
    assert e["deepspeed_config"] == str(EXAMPLE)


# ------------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("ds, message", [
    ('{\n  "train_batch_size": 32,\n  "gradient_clipping": 0.5\n  "fp16": {}\n}',
     "is not valid JSON: Expecting ',' delimiter at line 4, column 3"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ({"gradient_cliping": 1.0}, "DeepSpeed key 'gradient_cliping' is not supported (did you mean 'gradient_clipping'"),
    ({"activation_checkpointing": {}}, "'activation_checkpointing' is not supported"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size=30 must equal train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=2 x "
     "scaling.num_workers=2 = 16"),
    ({"train_batch_size": 30}, "train_batch_size=30 is not divisible by gradient_accumulation_steps=2 x "
                               "scaling.num_workers=2"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "is not a multiple of "
                                                                    "train_micro_batch_size_per_gpu=4"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu must be an integer, got 2.5"),
    ({"gradient_clipping": 0.5, "max_grad_norm": 1.0}, "gradient_clipping=0.5 and max_grad_norm=1.0 disagree"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"fp16": {"enabled": "auto"}}, "fp16.enabled must be true or false, got 'auto'"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale=128 is not supported"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "offload_optimizer.device must be 'cpu' or 'none', got 'nvme' (NVMe offload is not supported"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 4}}},
     "'zero_optimization.offload_optimizer.buffer_count' is not supported"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": True}}, "'zero_optimization.overlap_comm' is not supported"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "engine.offload_optimizer=cpu is ZeRO-Offload: it needs engine.zero_stage 1, 2 or 3, got 0"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "engine.offload_param=cpu partitions parameters: it needs engine.zero_stage=3, got 2"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "Lamb"}},
     "DeepSpeed's CPU Adam, which has no Lamb"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type 'OneBitAdam' is not supported"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "use the top-level gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, "'optimizer.params.torch_adam' is not supported"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "betas must be a list of two numbers"),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.type 'OneCycle' is not supported"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}},
     "WarmupDecayLR needs scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_type": "cosine"}}},
     "warmup_type must be 'log' or 'linear'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_min_lr": 1.0}}},
     "train.warmup_min_lr=1.0 exceeds train.lr"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "warmup_num_steps must be >= 1"),
])
def test_bad_deepspeed_config_is_a_config_error_naming_the_problem(tmp_path, ds, message):
    with pytest.raises(ConfigError) as info:
        resolved(tmp_path, ds)
    assert message in str(info.value)
    if "engine.deepspeed_config" in str(info.value) or "ds.json" in str(info.value):
        assert str(tmp_path / "ds.json") in str(info.value)


def test_missing_file_names_it(tmp_path):
    cfg = recipes.get("lm_debug").override({"name": "t", "engine.deepspeed_config": str(tmp_path / "nope.json")})
    with pytest.raises(ConfigError, match="engine.deepspeed_config: no such file .*nope.json"):
        resolve(cfg)


def test_deepspeed_only_schedule_keys_are_refused_elsewhere():
    cfg = recipes.get("lm_debug").override({"name": "t", "train.warmup_type": "log"})
    with pytest.raises(ConfigError, match="apply to train.schedule=warmup or warmup_decay"):
        resolve(cfg)


# ------------------------------------------------------------------------------------------------ optimizers

def test_deepspeed_optimizers_by_name_go_to_the_deepspeed_config(monkeypatch):
    base = {"name": "t", "scaling.device": "cpu", "train.lr": 1e-3, "train.beta1": 0.8, "train.beta2": 0.999,
            "train.eps": 1e-6, "train.weight_decay": 0.01}
    assert "optimizer" not in deepspeed_config(recipes.get("lm_debug").override(base))  # torch_adamw: efftx builds it
    ds = deepspeed_config(recipes.get("lm_debug").override({**base, "engine.optimizer": "adam"}))
    assert ds["optimizer"] == {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-6,
                                                          "weight_decay": 0.01, "adam_w_mode": False,
                                                          "torch_adam": True}}  # CPU: no op to compile
    on_gpu = {**base, "engine.optimizer": "adamw", "scaling.device": "cuda"}
    monkeypatch.setattr(engine_lib.shutil, "which", lambda name: "/usr/local/cuda/bin/nvcc" if name == "nvcc" else None)
    ds = deepspeed_config(recipes.get("lm_debug").override(on_gpu))
    assert ds["optimizer"]["type"] == "AdamW" and "torch_adam" not in ds["optimizer"]["params"]  # FusedAdam
    # a GPU worker without the CUDA toolkit cannot build FusedAdam: torch's AdamW
    monkeypatch.setattr(engine_lib.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert deepspeed_config(recipes.get("lm_debug").override(on_gpu))["optimizer"]["params"]["torch_adam"] is True
    with pytest.raises(ConfigError, match="engine.optimizer=lamb .* needs CUDA"):
        deepspeed_config(recipes.get("lm_debug").override({**base, "engine.optimizer": "lamb"}))
    # FusedLamb is not among DeepSpeed's ZeRO optimizers (it asserts): refused with ZeRO, named
    lamb = {**base, "engine.optimizer": "lamb", "scaling.device": "cuda"}
    assert deepspeed_config(recipes.get("lm_debug").override(lamb))["optimizer"]["type"] == "Lamb"
    with pytest.raises(ConfigError, match=r"lamb .* not one DeepSpeed runs under ZeRO \(engine.zero_stage=2\)"):
        deepspeed_config(recipes.get("lm_debug").override({**lamb, "engine.zero_stage": 2}))
    # ZeRO-Offload: DeepSpeed must build its CPU Adam (it refuses torch's optimizers with offload)
    offload = {**base, "engine.optimizer": "adam", "engine.zero_stage": 3, "engine.offload_optimizer": "cpu",
               "engine.offload_param": "cpu"}
    ds = deepspeed_config(recipes.get("lm_debug").override(offload))
    assert "torch_adam" not in ds["optimizer"]["params"]
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                       "offload_param": {"device": "cpu", "pin_memory": False}}
    ds = deepspeed_config(recipes.get("lm_debug").override({**offload, "scaling.device": "cuda"}))
    assert ds["zero_optimization"]["offload_optimizer"]["pin_memory"] is True  # pinned host memory on GPUs


# ------------------------------------------------------------------------------------------------ schedules

def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    """The learning rate each of ``steps`` optimizer steps runs at, the scheduler stepped after each (as the
    DeepSpeed engine does)."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: changes nothing
        scheduler.step()
    return out


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-4, "warmup_num_steps": 10}),  # log (the default)
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1}),  # DeepSpeed: max(2, n)
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 8, "total_num_steps": 30}),
    ("WarmupDecayLR", {"warmup_min_lr": 2e-5, "warmup_max_lr": 5e-4, "warmup_num_steps": 6, "warmup_type": "linear",
                       "total_num_steps": 25}),
])
def test_schedule_matches_deepspeeds_scheduler_step_for_step(tmp_path, kind, params):
    from deepspeed.runtime import lr_schedules

    cfg = resolved(tmp_path, {"scheduler": {"type": kind, "params": params}}, **{"train.steps": 40})
    steps = cfg.train.steps + 5  # past the end too
    theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    ours = Schedule(ours_opt, cfg)
    expected = _lrs(theirs, theirs_opt, steps)
    assert len(set(expected)) > 1  # a real shape, not a constant
    assert _lrs(ours, ours_opt, steps) == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_warmup_decay_shape():
    cfg = recipes.get("lm_debug").override({"name": "t", "train.schedule": "warmup_decay", "train.steps": 30,
                                            "train.warmup_steps": 10, "train.warmup_type": "linear"})
    f = lr_lambda(cfg)
    assert [f(s) for s in (0, 1, 2, 6, 10)] == pytest.approx([0, 0, 0.1, 0.5, 0.9])  # DeepSpeed's step - 1 lag
    assert f(11) == pytest.approx(1.0)
    decay = [f(s) for s in range(11, 32)]
    assert all(a > b for a, b in zip(decay[:-2], decay[1:-1]))  # strictly down to ...
    assert f(31) == 0.0 and f(40) == 0.0  # ... 0 (warmup_min_lr) at train.steps (iteration 30)
    assert f(21) == pytest.approx((30 - 20) / 20)
    log = lr_lambda(recipes.get("lm_debug").override({"name": "t", "train.schedule": "warmup",
                                                      "train.warmup_steps": 10, "train.warmup_type": "log"}))
    assert log(5) == pytest.approx(math.log(5) / math.log(10)) and log(500) == 1.0


DEEPSPEED_BUILDS_ITS_OPTIMIZER = r"""
import json, os, socket, sys
import torch, torch.distributed as dist
from efftx import recipes
from efftx.train import engine as engine_lib

engine_lib.set_accelerator_env("cpu")  # as a worker does: DeepSpeed's compiled ops from the venv's cache
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
out = {}
for name in ("adam", "adamw"):
    cfg = recipes.get("lm_debug").override({
        "name": "t", "scaling.device": "cpu", "engine.optimizer": name, "train.lr": 1e-3, "train.beta1": 0.8,
        "train.beta2": 0.999, "train.eps": 1e-6, "train.weight_decay": 0.01, "train.schedule": "warmup",
        "train.warmup_type": "log", "train.warmup_steps": 4})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    engine, optimizer, scheduler = engine_lib.initialize(model, cfg)
    lrs = []
    for _ in range(6):
        lrs.append(engine.basic_optimizer.param_groups[0]["lr"])
        for _ in range(cfg.train.grad_accum):
            engine.backward(engine(torch.ones(2, 4)).square().sum())
            engine.step()
    groups = engine.basic_optimizer.param_groups
    out[name] = {"type": type(engine.basic_optimizer).__name__, "lrs": lrs,
                 "betas": list(groups[0]["betas"]), "eps": groups[0]["eps"],
                 "decay": [g["weight_decay"] for g in groups], "schedule": type(scheduler).__name__}
print("RESULT " + json.dumps(out))
"""


def test_deepspeed_builds_torch_adam_on_cpu_with_efftx_schedule(tmp_path):
    """engine.optimizer=adam|adamw: DeepSpeed builds the optimizer from its config (torch's, on CPU: nothing to
    compile), with efftx's weight-decay groups and Schedule on top. One process, no Ray."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_BUILDS_ITS_OPTIMIZER], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    cfg = recipes.get("lm_debug").override({"name": "t", "train.lr": 1e-3, "train.schedule": "warmup",
                                            "train.warmup_type": "log", "train.warmup_steps": 4})
    expected_lrs = [1e-3 * lr_lambda(cfg)(s) for s in range(6)]
    for name, cls in (("adam", "Adam"), ("adamw", "AdamW")):
        got = out[name]
        assert got["type"] == cls and got["schedule"] == "Schedule"
        assert got["betas"] == [0.8, 0.999] and got["eps"] == 1e-6
        assert got["decay"] == [0.01, 0.0]  # matrices only
        assert got["lrs"] == pytest.approx(expected_lrs)


def test_a_sweep_over_a_key_the_file_sets_is_refused(tmp_path, monkeypatch):
    from efftx import tuning
    from efftx.train import launch

    def no_ray():
        raise AssertionError("the sweep got as far as starting Ray")

    monkeypatch.setattr(launch, "ensure_ray", no_ray)  # refused before any trial: this test never starts Ray
    (tmp_path / "ds.json").write_text(json.dumps({"gradient_clipping": 0.5}))
    monkeypatch.setitem(tuning.SPACES, "clip", tuning.Space("clip", "lm_debug", grid={"train.grad_clip": [0.5, 1.0]}))
    with pytest.raises(ConfigError, match="the sweep varies train.grad_clip, which engine.deepspeed_config"):
        tuning.sweep("clip", overrides=[f"engine.deepspeed_config={tmp_path / 'ds.json'}"])


# ------------------------------------------------------------------------------------------------ ZeRO-Offload

ZERO_OFFLOAD = r"""
import json, os, socket, sys, tempfile
import torch, torch.distributed as dist
from efftx import recipes
from efftx.train import engine as engine_lib

engine_lib.set_accelerator_env("cpu")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
CASES = {
    "none": {},
    "zero2_torch_adamw": {"engine.zero_stage": 2, "engine.offload_optimizer": "cpu"},
    "zero2_adamw": {"engine.zero_stage": 2, "engine.offload_optimizer": "cpu", "engine.optimizer": "adamw"},
    "zero3_params": {"engine.zero_stage": 3, "engine.offload_optimizer": "cpu", "engine.offload_param": "cpu"},
}
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def build(over):
    cfg = recipes.get("lm_debug").override({"name": "t", "scaling.device": "cpu", "train.lr": 1e-2, "train.beta1": 0.8,
                                            "train.beta2": 0.999, "train.weight_decay": 0.1, "train.grad_accum": 1,
                                            **over})
    cfg.validate()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8), torch.nn.LayerNorm(8))
    return engine_lib.initialize(model, cfg)[0]


def train(engine, steps):
    losses = []
    for _ in range(steps):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with torch.no_grad():  # the last update too, in float64 so that no rounding hides a difference
        losses.append(engine(x).double().square().mean().item())
    return losses


out = {}
for name, over in CASES.items():
    engine = build(over)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out[name] = {"optimizer": type(inner).__name__, "wrapper": type(engine.optimizer).__name__,
                 "losses": train(engine, 8)}
    if name != "none":  # save at step 5, a fresh engine resumes: steps 6-8 as the uninterrupted run's (CPU Adam's
        first = build(over)  # step 6 with betas 0.8 / 0.999 is one where pow(beta, step) and the product differ)
        train(first, 5)
        folder = tempfile.mkdtemp()
        first.save_checkpoint(folder, tag="t")
        resumed = build(over)
        resumed.load_checkpoint(folder, tag="t", load_optimizer_states=True, load_lr_scheduler_states=True)
        out[name]["replayed_to"] = engine_lib.replay_cpu_adam_steps(resumed)
        out[name]["resumed"] = train(resumed, 3)
print("RESULT " + json.dumps(out))
"""


def test_zero_offload_trains_like_no_offload_and_resumes_exactly(tmp_path):
    """engine.offload_optimizer / offload_param through DeepSpeed (one process, gloo, no Ray): the optimizer is
    DeepSpeed's CPU Adam behind the ZeRO optimizer (built by efftx for torch_adamw, by DeepSpeed for adamw), the
    losses follow the run without offload (the same AdamW math), and a checkpoint taken mid-run resumes with the
    very same losses (the CPU Adam's bias-correction products replayed: efftx.train.engine.replay_cpu_adam_steps)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", ZERO_OFFLOAD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    base = out.pop("none")
    assert base["optimizer"] == "AdamW" and base["losses"][-1] < base["losses"][0] * 0.9  # it learns
    for name, got in out.items():
        assert got["optimizer"] == "DeepSpeedCPUAdam", name
        assert got["wrapper"] == ("DeepSpeedZeroOptimizer_Stage3" if "zero3" in name else "DeepSpeedZeroOptimizer")
        assert got["losses"] == pytest.approx(base["losses"], rel=1e-5), name
        assert got["replayed_to"] == 5
        assert got["resumed"] == got["losses"][5:], name  # bit for bit, and the final weights' loss


def test_compiled_ops_are_cached_with_the_venv_unless_the_user_says_otherwise(monkeypatch, tmp_path):
    import sys

    from efftx.train import ops

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert ops.use_venv_cache() == str(Path(sys.prefix) / "torch_extensions")
    assert ops.os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")  # workers inherit it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ops.use_venv_cache() == str(tmp_path)  # a user's choice stays
    with pytest.raises(SystemExit) as info:
        ops.main(["cpu_adamw"])
    assert info.value.code == 2


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(monkeypatch, tmp_path, capsys):
    """A process killed while DeepSpeed built an op leaves ``<op>/lock``; every later run waited on it forever
    (seen: two Ray Train workers blocked in FileBaton.wait). Locks older than any build are cleared when the
    cache is chosen; a lock a build may still hold is kept."""
    import os
    import time

    from efftx.train import ops

    now = time.time()
    built, unbuilt, fresh = (tmp_path / name for name in ("built_op", "unbuilt_op", "fresh_op"))
    for op in (built, unbuilt, fresh):
        op.mkdir()
        (op / "lock").touch()
    (built / "built_op.so").touch()
    (fresh / "fresh_op.so").touch()
    os.utime(built / "lock", (now - ops.STALE_LOCK_BUILT_S - 5,) * 2)  # built long ago: stale
    os.utime(unbuilt / "lock", (now - ops.STALE_LOCK_BUILT_S - 5,) * 2)  # no .so yet: a slow build may hold it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ops.use_venv_cache() == str(tmp_path)
    assert not (built / "lock").exists()
    assert (unbuilt / "lock").exists() and (fresh / "lock").exists()
    assert "a build lock 10 minutes old" in capsys.readouterr().err
    os.utime(unbuilt / "lock", (now - ops.STALE_LOCK_UNBUILT_S - 5,) * 2)  # no build takes an hour
    assert ops.clear_stale_locks(tmp_path, log=lambda m: None) == [unbuilt / "lock"]
    assert (fresh / "lock").exists()


def test_deepspeed_asks_py_cpuinfo_once_per_process(monkeypatch):
    """DeepSpeed asks py-cpuinfo for the CPU (a child Python process per call, about a second) twice when it loads
    CPU Adam's op (its compiler flags) and once per CPU Adam it builds (ZeRO-Offload):
    efftx.train.ops.remember_cpu_info keeps the first answer for the process."""
    import cpuinfo
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    from efftx.train import ops

    calls = []
    real = cpuinfo.get_cpu_info()

    def counting():
        calls.append(1)
        return dict(real)

    monkeypatch.setattr(cpuinfo, "get_cpu_info", counting)
    builder = CPUAdamBuilder()
    flags = builder.cxx_args()  # DeepSpeed's own code: cpu_arch() and simd_width() each ask py-cpuinfo
    assert len(calls) == 2
    assert ops.remember_cpu_info() and ops.remember_cpu_info()  # idempotent: one memo
    assert builder.cxx_args() == flags and builder.cxx_args() == flags  # the same compiler flags: no rebuild
    assert len(calls) == 3  # one more call in all, then the kept answer
    cpuinfo.get_cpu_info()["arch"] = "edited"  # a caller editing its copy changes nothing kept
    assert cpuinfo.get_cpu_info()["arch"] == real["arch"]
