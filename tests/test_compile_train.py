"""engine.compile: torch.compile of the training forward, its eager fallback and its config key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from efftx import models, recipes
from efftx.errors import ConfigError
from efftx.train import engine as engine_lib


def _train_losses(cfg, compile_device: str | None, steps: int = 3):
    """Losses of ``steps`` train steps of the recipe's model (engine's AdamW and schedule, fixed batches), the log
    lines and the trained parameters; with ``compile_device`` the model goes through engine.compile_model first."""
    torch.manual_seed(0)
    model = models.build(cfg)
    messages: list[str] = []
    if compile_device is not None:
        engine_lib.compile_model(model, cfg, compile_device, log=messages.append)
    opt = engine_lib.torch_adamw(engine_lib.param_groups(model, cfg.train.weight_decay), cfg.train)
    sched = engine_lib.Schedule(opt, cfg)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.model.vocab_size, (steps, 2, cfg.data.seq_len + 1), generator=gen)
    losses = []
    model.train()
    for batch in data:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, messages, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.slow  # compiling costs ~20 s of CPU (a minute on a loaded 2-core machine)
def test_compiled_training_matches_eager():
    cfg = recipes.get("lm_debug").override({"engine.compile": "on", "data.seq_len": 16, "model.depth": 1})
    eager, _, eager_params = _train_losses(cfg, None)
    compiled, messages, compiled_params = _train_losses(cfg, "cpu")
    assert any("compiled with torch.compile" in m for m in messages), messages
    assert not any("failed" in m for m in messages), messages  # it really ran compiled, no fallback
    assert compiled == pytest.approx(eager, rel=1e-5)
    # the losses of a freshly initialised model barely depend on attention: the trained weights show its gradients
    torch.testing.assert_close(compiled_params, eager_params, rtol=1e-4, atol=1e-6)
    assert len(set(eager)) == len(eager)  # the weights change between steps: the optimizer path is compared too


def test_eval_mode_runs_eager_and_state_dict_keys_are_unchanged():
    cfg = recipes.get("lm_debug").override({"engine.compile": "on"})
    model = models.build(cfg)
    keys = list(model.state_dict())
    assert engine_lib.compile_model(model, cfg, "cpu", log=lambda m: None)
    assert list(model.state_dict()) == keys  # checkpoints and exports see the same model
    calls = []
    model.forward.compiled = lambda *a, **k: calls.append(1)  # would record a compiled call
    model.eval()
    tokens = torch.randint(0, 256, (1, 8))
    out = model(tokens)
    assert out.shape == (1, 8, 256) and calls == []


def test_a_failed_compile_falls_back_to_eager_and_says_why(monkeypatch):
    def broken(fn, *args, **kwargs):
        def run(*a, **k):
            raise RuntimeError("inductor exploded\nlong traceback")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    cfg = recipes.get("lm_debug").override({"engine.compile": "on"})
    torch.manual_seed(0)
    model = models.build(cfg)
    torch.manual_seed(0)
    reference = models.build(cfg)
    messages: list[str] = []
    assert engine_lib.compile_model(model, cfg, "cpu", log=messages.append)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
    assert messages[-1] == "engine.compile: torch.compile failed, running eager (RuntimeError: inductor exploded)"
    model(tokens)
    assert len(messages) == 2  # logged once; later calls go straight to eager


def test_auto_runs_eager_on_cpu_and_says_why():
    cfg = recipes.get("lm_debug").override({"engine.compile": "auto"})
    model = models.build(cfg)
    messages: list[str] = []
    assert not engine_lib.compile_model(model, cfg, "cpu", log=messages.append)
    assert "forward" not in vars(model)  # the class's forward, untouched
    assert messages == ["engine.compile=auto: running eager (engine.compile=auto compiles on CUDA only (on CPU it has "
                        "not been shown to pay; set it to on))"]
    assert engine_lib.compile_reason(cfg, "cuda") is None
    off = recipes.get("lm_debug")  # the default: off, and silent
    assert off.engine.compile == "off"
    assert not engine_lib.compile_model(model, off, "cpu", log=messages.append) and len(messages) == 1


def test_no_cpp_compiler_runs_eager(monkeypatch):
    monkeypatch.setattr(engine_lib.shutil, "which", lambda name: None)
    cfg = recipes.get("lm_debug").override({"engine.compile": "on"})
    assert "no C++ compiler" in engine_lib.compile_reason(cfg, "cpu")


@pytest.mark.parametrize("value", ["yes", "true", "ON", ""])
def test_bad_compile_value_is_a_config_error_naming_the_key(value):
    cfg = recipes.get("lm_debug").override({"engine.compile": value})
    with pytest.raises(ConfigError, match=r"engine.compile must be one of off, auto, on"):
        cfg.engine.validate()
