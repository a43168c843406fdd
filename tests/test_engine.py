import math

import pytest
import torch

from efftx import paths, recipes
from efftx.train.engine import deepspeed_config, lr_lambda, param_groups
from efftx.train.launch import resolve


def cfg_with(**overrides):
    return recipes.get("lm_debug").override({"name": "t", **overrides})


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = cfg_with(**{"train.steps": 100, "train.warmup_steps": 10, "train.min_lr_ratio": 0.1})
    f = lr_lambda(cfg)
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100) == pytest.approx(0.1) and f(1000) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("precision, key", [("bf16", "bf16"), ("fp16", "fp16")])
def test_deepspeed_config_follows_run_config(precision, key):
    cfg = cfg_with(**{"engine.precision": precision, "engine.zero_stage": 2, "train.grad_clip": 0.5,
                      "train.grad_accum": 3, "train.micro_batch_size": 5})
    ds = deepspeed_config(cfg)
    assert ds[key]["enabled"] is True
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_micro_batch_size_per_gpu"] == 5
    if precision == "fp16":
        assert ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
        assert ds["fp16"]["initial_scale_power"] == cfg.engine.initial_scale_power
    assert "fp16" not in deepspeed_config(cfg_with()) and "bf16" not in deepspeed_config(cfg_with())


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.ndim for p in decay["params"]] == [2]
    assert no_decay["weight_decay"] == 0.0 and all(p.ndim == 1 for p in no_decay["params"])


def test_resolve_fills_machine_defaults(monkeypatch, tmp_path):
    cfg = recipes.get("lm_debug")
    resolved = resolve(cfg)
    assert resolved.name.startswith("lm_debug-")
    assert resolved.tracking.uri == f"sqlite:///{paths.home() / 'mlflow.db'}"
    assert resolved.scaling.storage_path == str(paths.home() / "runs")
    assert cfg.name == ""  # the recipe's config is not modified
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///" + str(tmp_path / "other.db"))
    assert resolve(cfg).tracking.uri.endswith("other.db")
    monkeypatch.setenv("EFFTX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve(cfg).scaling.storage_path == str(tmp_path / "home" / "runs")


def test_torch_adamw_is_fused_and_steps_like_torchs_default_adamw():
    """engine.optimizer=torch_adamw uses the fused kernel (one pass per parameter: the default CPU AdamW's six
    elementwise passes were a sixth of a seq-512 train step); same hyperparameters, same updates to rounding."""
    from efftx.train.engine import torch_adamw

    cfg = cfg_with(**{"train.lr": 1e-2, "train.beta1": 0.8, "train.beta2": 0.99, "train.eps": 1e-6,
                      "train.weight_decay": 0.1})
    torch.manual_seed(0)
    models_ = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(2)]
    models_[1].load_state_dict(models_[0].state_dict())
    fused = torch_adamw(param_groups(models_[0], 0.1), cfg.train)
    t = cfg.train
    plain = torch.optim.AdamW(param_groups(models_[1], 0.1), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    assert fused.defaults["betas"] == (0.8, 0.99) and fused.defaults["eps"] == 1e-6
    x = torch.randn(16, 8)
    for _ in range(5):
        for model, opt in zip(models_, (fused, plain)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models_[0].parameters(), models_[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(models_[0][0].weight, torch.nn.Linear(8, 8).weight)
