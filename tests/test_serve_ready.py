"""`make serve`'s first step (python -m efftx.serving.ready): the models a Serve config names are made servable:
ready ones left alone, a registered model without @champion promoted from its @candidate, a missing one trained
by its recipe's job first (the real job, on the session's Ray cluster) and then promoted."""

from __future__ import annotations

from pathlib import Path

import pytest

from efftx.export import resolve_export
from efftx.serving.ready import main
from efftx.tracking import client_for

YAML = """applications:
  - name: text
    import_path: efftx.serving.text:build
    args:
{args}
"""


def config(tmp_path: Path, **args) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(YAML.format(args="\n".join(f"      {k}: {v}" for k, v in args.items())))
    return str(path)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_check_names_what_is_missing_and_the_one_job_that_trains_a_pair(tmp_path, registry, capsys):
    yaml = config(tmp_path, target="models:/spec_target_debug@champion", draft="models:/spec_draft_debug@champion")
    assert main([yaml, "--check"]) == 1
    out = capsys.readouterr().out
    assert "target: models:/spec_target_debug@champion is missing (not registered)" in out
    assert out.count("to train: python jobs/train_speculative.py --size debug") == 1  # one job trains both
    assert "then: python -m efftx.promote spec_draft_debug candidate" in out


@pytest.mark.parametrize("text, message", [
    ("applications: 3\n", "has no 'applications' list"),
    ("applications:\n  - import_path: other:app\n", "has no efftx.serving.text:build application with a model"),
    ("applications: [\n", "is not valid YAML"),
])
def test_bad_config_is_exit_2_naming_it(tmp_path, registry, capsys, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    assert main([str(tmp_path / "bad.yaml")]) == 2
    assert message in capsys.readouterr().err


def test_a_model_no_recipe_trains_is_exit_2_before_anything_runs(tmp_path, registry, capsys):
    assert main([config(tmp_path, target="models:/my_model@champion")]) == 2
    err = capsys.readouterr().err
    assert "'my_model' is no efftx recipe, so nothing here can train it" in err and "change target in" in err


@pytest.mark.slow
def test_a_missing_model_is_trained_promoted_and_then_ready(tmp_path, registry, ray_cluster, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)  # the job joins the session's cluster
    yaml = config(tmp_path, target="models:/lm_debug@champion")
    assert main([yaml]) == 0
    out = capsys.readouterr().out
    assert "training lm_debug (not in the registry yet): python jobs/train_lm.py --recipe lm_debug" in out
    assert "promoted lm_debug version 1 to @champion: there was no @champion" in out
    assert resolve_export("models:/lm_debug@champion", registry).is_dir()
    # a version registered but never promoted (what a second training run leaves) is promoted, not retrained
    client_for(registry).delete_registered_model_alias("lm_debug", "champion")
    assert main([yaml]) == 0
    out = capsys.readouterr().out
    assert "no @champion yet" in out and "training" not in out and "promoted lm_debug version 1" in out
    assert main([yaml, "--check"]) == 0 and "is ready" in capsys.readouterr().out
