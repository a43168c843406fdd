import json

import pytest

from efftx import recipes
from efftx.config import Config, all_keys
from efftx.errors import ConfigError


def test_overrides_convert_to_field_types():
    cfg = Config().override(["train.lr=3e-4", "model.depth=6", "model.rotary=false", "data.corpus=/x/y.gz",
                             "scaling.cpus_per_worker=0.5", "train.steps=1e3"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.model.depth == 6 and isinstance(cfg.model.depth, int)
    assert cfg.model.rotary is False
    assert cfg.data.corpus == "/x/y.gz"
    assert cfg.scaling.cpus_per_worker == 0.5
    assert cfg.train.steps == 1000


def test_unknown_key_names_key_and_close_matches():
    with pytest.raises(ConfigError) as err:
        Config().override(["train.lrr=1"])
    assert "train.lrr" in str(err.value) and "train.lr" in str(err.value)
    with pytest.raises(ConfigError, match="unknown config key 'nosection.x'"):
        Config().set("nosection.x", 1)


@pytest.mark.parametrize("assignment, expected", [
    ("train.steps=abc", "train.steps expects an integer"),
    ("train.steps=1.5", "train.steps expects an integer"),
    ("train.lr=fast", "train.lr expects a number"),
    ("model.rotary=maybe", "model.rotary expects true/false"),
    ("train.lr", "not of the form key=value"),
])
def test_wrong_values_name_the_key(assignment, expected):
    with pytest.raises(ConfigError, match=expected):
        Config().override([assignment])


def test_dict_round_trip_and_flat_keys():
    cfg = recipes.get("lm_debug")
    cfg.name = "x"
    again = Config.from_dict(json.loads(cfg.to_json()))
    assert again == cfg
    flat = cfg.flat()
    assert set(flat) == set(all_keys())
    assert flat["model.dim"] == cfg.model.dim and flat["recipe"] == "lm_debug"


def test_from_dict_is_strict():
    with pytest.raises(ConfigError, match="train.bogus"):
        Config.from_dict({"train": {"bogus": 1}})
    with pytest.raises(ConfigError, match="train.steps expects an integer"):
        Config.from_dict({"train": {"steps": "many"}})
    with pytest.raises(ConfigError, match="'model' is a config section"):
        Config.from_dict({"model": 3})


@pytest.mark.parametrize("assignment, expected", [
    ("model.kv_heads=3", "multiple of model.kv_heads"),
    ("data.seq_len=4096", "exceeds model.max_seq_len"),
    ("engine.zero_stage=4", "engine.zero_stage"),
    ("engine.precision=fp8", "engine.precision must be one of"),
    ("train.steps=0", "train.steps must be > 0"),
    ("train.warmup_steps=100000", "train.warmup_steps"),
    ("name=../escape", "run name"),
])
def test_validate_names_the_keys(assignment, expected):
    cfg = recipes.get("lm_debug").override({"name": "ok"})
    cfg.override([assignment])
    with pytest.raises(ConfigError, match=expected):
        cfg.validate()


def test_recipes_are_valid_and_unknown_recipe_suggests():
    for name in recipes.names():
        cfg = recipes.get(name)
        cfg.name = "check"
        cfg.validate()
        assert cfg.recipe == name
    with pytest.raises(ConfigError, match="did you mean lm_debug"):
        recipes.get("lm_debugg")


def test_recipe_instances_are_independent():
    a = recipes.get("lm_debug")
    a.train.lr = 123.0
    assert recipes.get("lm_debug").train.lr != 123.0
