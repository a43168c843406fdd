"""A backend owns its config: one module registers the class and its options section, which the config,
its validation, the CLI/Tune keys and the contract tests (tests/test_attention_contract.py) pick up with no
edit elsewhere. ``local`` (efftx/attention/local.py) is the proof: it was added as that one file."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest
import torch

from efftx import attention, models, recipes, tuning
from efftx.attention.base import AttentionSpec
from efftx.attention.local import LocalAttention, LocalOptions
from efftx.config import Config, all_keys
from efftx.errors import ConfigError

ATTENTION_DIR = Path(attention.__file__).parent
PLATFORM = ATTENTION_DIR.parents[1]  # the folder holding the efftx package


def local_config(*assignments: str) -> Config:
    return recipes.get("lm_debug").override(["name=local", "attention.kind=local", *assignments])


# ------------------------------------------------------------------------------------------ registry and config

def test_registry_discovers_local_and_its_options_section():
    assert "local" in attention.names() and attention.get("local") is LocalAttention
    assert attention.option_sections()["local"] is LocalOptions
    assert Config().attention.local == LocalOptions()
    assert "attention.local.window_size" in all_keys()


def test_set_style_overrides_validate_and_build_a_working_lm():
    cfg = local_config("attention.local.window_size=16").validate()
    assert cfg.attention.local.window_size == 16
    torch.manual_seed(0)
    model = models.build(cfg).eval()
    assert all(block.attention.inner.window == 16 for block in model.blocks)
    logits = model(torch.randint(0, cfg.model.vocab_size, (2, 40)))
    assert logits.shape == (2, 40, cfg.model.vocab_size) and torch.isfinite(logits).all()


def test_the_job_command_line_takes_the_new_backend(capsys):
    """``jobs/train_lm.py --set attention.kind=local --set attention.local.window_size=16`` (its --print-config
    resolves and validates without training); a bad window is the CLI's one-line error, exit code 2."""
    from efftx.cli import train_main

    args = ["--recipe", "lm_debug", "--set", "attention.kind=local", "--print-config"]
    assert train_main([*args, "--set", "attention.local.window_size=16"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["attention"]["kind"] == "local" and printed["attention"]["local"] == {"window_size": 16}
    assert train_main([*args, "--set", "attention.local.window_size=-1"]) == 2
    assert "attention.local.window_size must be > 0, got -1" in capsys.readouterr().err


def test_bad_window_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="attention.local.window_size must be > 0, got 0"):
        local_config("attention.local.window_size=0").validate()
    local_config("attention.local.window_size=0", "attention.kind=full").validate()  # unused sections: not checked


def test_dalle_checks_the_sections_of_its_layer_types():
    cfg = Config().override({"name": "x", "model.family": "dalle", "dalle.attn_types": "full,conv_like",
                             "attention.conv_like.kernel_size": 4})
    with pytest.raises(ConfigError, match="attention.conv_like.kernel_size must be odd, got 4"):
        cfg.validate()
    cfg.dalle.attn_types = "full,axial_row"  # conv_like unused: its section is not checked
    cfg.validate()


def test_old_config_json_without_the_new_section_still_loads():
    """Exports written before a backend was added have no section for it: it gets its defaults."""
    data = recipes.get("lm_debug").to_dict()
    del data["attention"]["local"]
    assert Config.from_dict(data).attention.local == LocalOptions()


def test_tune_grid_over_the_new_key():
    space = tuning.Space("local window sizes", "lm_debug", grid={"attention.local.window_size": [8, 16]})
    points = tuning.points(space, local_config())
    assert points == [{"attention.local.window_size": 8}, {"attention.local.window_size": 16}]


# ------------------------------------------------------------------------------------------ imports and shared rules

def _imported_modules(node: ast.AST) -> list[str]:
    """Modules an import statement depends on: ``from a.b import c`` is a.b.c when that is a module, else a.b."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        out = []
        for alias in node.names:
            sub = f"{node.module}.{alias.name}"
            is_module = (PLATFORM / sub.replace(".", "/")).with_suffix(".py").exists() or \
                (PLATFORM / sub.replace(".", "/") / "__init__.py").exists()
            out.append(sub if is_module else node.module)
        return out
    return []


def test_backend_modules_import_neither_the_config_nor_the_attention_package():
    for path in sorted(ATTENTION_DIR.glob("*.py")):
        if path.name == "__init__.py":
            continue
        imported = {m for node in ast.walk(ast.parse(path.read_text())) for m in _imported_modules(node)}
        bad = imported & {"efftx.config", "efftx.attention"}
        assert not bad, f"{path.name} imports {bad}"


def test_heads_must_be_a_multiple_of_kv_heads_once_in_the_spec():
    with pytest.raises(ConfigError, match=r"model.heads=4 must be a multiple of model.kv_heads=3"):
        AttentionSpec(kind="full", dim=16, heads=4, kv_heads=3, head_dim=4, max_seq_len=8)
    for path in [*ATTENTION_DIR.glob("*.py"), PLATFORM / "efftx" / "config.py"]:
        if path.name != "base.py":
            assert not re.search(r"heads\s*%", path.read_text()), f"{path.name} repeats the heads/kv_heads rule"


def test_a_backend_fills_in_its_default_options():
    spec = AttentionSpec(kind="local", dim=16, heads=4, kv_heads=2, head_dim=4, max_seq_len=8)
    assert attention.build(spec).spec.options == LocalOptions()


# ------------------------------------------------------------------------------------------ the local backend

def band_attention(q, k, v, window: int):
    """Textbook softmax attention with GQA under an explicit causal band mask, in float64."""
    b, t, h, d = q.shape
    k, v = (x.repeat_interleave(h // k.shape[2], dim=2).double() for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) / math.sqrt(d)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def build(kind: str, window: int = 128, dropout: float = 0.0):
    spec = AttentionSpec(kind=kind, dim=48, heads=6, kv_heads=2, head_dim=8, max_seq_len=64, dropout=dropout,
                         options=LocalOptions(window) if kind == "local" else None)
    return attention.build(spec).eval()


def qkv(t: int, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, 6, 8, generator=g), torch.randn(b, t, 2, 8, generator=g), \
        torch.randn(b, t, 2, 8, generator=g)


@pytest.mark.parametrize("window", [37, 200])
def test_a_window_covering_the_sequence_is_full_attention(window):
    q, k, v = qkv(37)
    torch.testing.assert_close(build("local", window)(q, k, v), build("full")(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [1, 3, 16, 20])
def test_a_small_window_is_full_attention_under_a_band_mask(window):
    q, k, v = qkv(45)  # several query blocks of max(window, MIN_QUERY_BLOCK)
    torch.testing.assert_close(build("local", window)(q, k, v).double(), band_attention(q, k, v, window),
                               rtol=1e-5, atol=1e-6)


def test_ragged_cache_rows_each_see_their_own_window():
    backend = build("local", 3)
    q, k, v = qkv(9)
    cache = backend.new_cache(2, 16, torch.device("cpu"), torch.float32)
    backend(q[:, :8], k[:, :8], v[:, :8], cache=cache)
    cache.rewind([3, 0])  # row 0 holds 5 tokens, row 1 holds 8
    step = backend(q[:, 8:9], k[:, 8:9], v[:, 8:9], cache=cache)  # row 0's token 5, row 1's token 8
    for row, n in ((0, 5), (1, 8)):
        seq = [torch.cat([x[row:row + 1, :n], x[row:row + 1, 8:9]], 1) for x in (q, k, v)]
        torch.testing.assert_close(step[row, 0].double(), band_attention(*seq, 3)[0, -1], rtol=1e-5, atol=1e-6)


def test_dropout_acts_in_training_only():
    backend = build("local", 4, dropout=0.5)
    q, k, v = qkv(12)
    torch.testing.assert_close(backend(q, k, v).double(), band_attention(q, k, v, 4), rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    assert not torch.allclose(backend.train()(q, k, v), backend.eval()(q, k, v))
