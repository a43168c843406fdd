"""Exports as MLflow models (efftx.mlflow_model) and the registry's aliases (efftx.promote), through the real
path: a sqlite MLflow registry in a temp folder, real exports of tiny models registered as training does
(Tracker.register), ``mlflow.pyfunc.load_model("models:/NAME@ALIAS")``; no Ray, no network."""

from __future__ import annotations

import base64
import io
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from efftx import promote, recipes
from efftx.errors import ExportError
from efftx.export import export, load_export, read_export_config, resolve_export
from efftx.models import build as build_model
from efftx.tracking import Tracker, client_for
from efftx.train import tasks

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A sqlite MLflow registry, also the default URI (MLFLOW_TRACKING_URI) for mlflow.pyfunc.load_model."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('registry') / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


@pytest.fixture
def no_network(monkeypatch):
    """Records (and refuses) every connection and name lookup; the test asserts the list stays empty."""
    attempts = []

    def refuse(what):
        def fn(*args, **kwargs):
            attempts.append((what, args[1:2] if what == "connect" else args[:2]))
            raise OSError(f"test: no network ({what})")
        return fn

    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    return attempts


def train_and_register(uri: str, root: Path, name: str, value: float | None, seed: int, recipe: str = "lm_debug",
                       overrides: dict | None = None, plain: bool = False, files: dict | None = None):
    """What a training run leaves: its metric logged at the last step, the export written, logged and registered
    (``plain``: registered as the plain artifact folder, the layout before MLflow models)."""
    cfg = recipes.get(recipe).override({"name": f"{name}-{seed}", "tracking.uri": uri, "tracking.model_name": name,
                                        **(overrides or {})})
    metric = tasks.get(cfg.model.family).metric
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    tracker = Tracker(cfg)
    if value is not None:
        tracker.log_metrics({metric: value}, cfg.train.steps)
    meta = {"step": cfg.train.steps, **({metric: value} if value is not None else {})}
    out = export(model, cfg, root / f"{name}-{seed}", meta, files=files)
    tracker.log_artifacts(str(out), "export")
    registered = tracker.register("export", None if plain else str(out))
    tracker.finish()
    return registered, out, tracker


def champion(uri: str, name: str) -> str:
    return str(client_for(uri).get_model_version_by_alias(name, "champion").version)


# ------------------------------------------------------------------------------------------- the pyfunc

def test_an_lm_version_loads_with_pyfunc_and_generates_as_efftx_generate(registry, tmp_path, no_network):
    import mlflow

    from efftx.generate import sample_text

    registered, out, tracker = train_and_register(registry, tmp_path, "lm_x", 2.0, seed=0)
    assert registered == "models:/lm_x/1"
    client = client_for(registry)
    assert str(client.get_model_version_by_alias("lm_x", "candidate").version) == "1"  # set by the training run
    t0 = time.perf_counter()
    model = mlflow.pyfunc.load_model("models:/lm_x@candidate")
    assert time.perf_counter() - t0 < 10
    rows = [{"prompt": "def ", "max_new_tokens": 12, "temperature": 0.8, "seed": 3},
            {"prompt": "hello wor", "max_new_tokens": 12, "temperature": 0.8, "seed": 11},  # batched with row 0
            {"prompt": "x", "max_new_tokens": 5, "temperature": 0.0, "top_k": 4}]
    expected = [sample_text(str(out), r["prompt"], r["max_new_tokens"], temperature=r["temperature"],
                            top_k=r.get("top_k", 0), seed=r.get("seed")) for r in rows]
    got = model.predict(rows)
    assert list(got.columns) == ["text"] and got["text"].tolist() == expected
    assert model.predict(pd.DataFrame(rows[1:2]))["text"].tolist() == expected[1:2]
    assert sample_text("models:/lm_x@candidate", "def ", 12, temperature=0.8, seed=3) == expected[0]  # --model URI
    assert [c.name for c in model.metadata.signature.inputs.inputs][:2] == ["prompt", "max_new_tokens"]
    with pytest.raises(ExportError, match="row 1: seed must be a whole number, got 1.5"):
        model.predict([{"prompt": "a"}, {"prompt": "b", "seed": 1.5}])

    # The layout: MLmodel, the code that builds the model, the export's files as artifacts; nothing pickled.
    folder = resolve_export("models:/lm_x@candidate", registry)
    model_dir = folder.parent
    assert (model_dir / "MLmodel").is_file() and (model_dir / "input_example.json").is_file()
    assert "loader_module: mlflow.pyfunc.loaders.code_model" in (model_dir / "MLmodel").read_text()
    assert not [p for p in model_dir.rglob("*") if p.suffix in (".pkl", ".pickle", ".pt", ".bin")]
    assert (folder / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    requirements = (model_dir / "requirements.txt").read_text().split()
    assert any(r.startswith("torch==") for r in requirements) and any(r.startswith("mlflow==") for r in requirements)
    assert load_export(model_dir)[2]["step"] == load_export(out)[2]["step"]  # an MLflow model folder loads too

    # A resumed run that exports again: the same version, no second logged model.
    again = Tracker(tracker.cfg, run_id=tracker.run_id).register("export", str(out))
    assert again == registered and len(client.search_model_versions("name='lm_x'")) == 1
    assert len(client.search_logged_models(experiment_ids=[client.get_run(tracker.run_id).info.experiment_id])) == 1
    assert no_network == []


def test_a_dalle_version_predicts_pngs_of_its_size(registry, tmp_path, no_network):
    import mlflow
    from PIL import Image

    from efftx.generation.png import png_bytes
    from efftx.generation.text_to_image import DalleGenerator

    from tokenizers import Tokenizer, models, pre_tokenizers

    from efftx.data.text_tokens import HFTokenizer

    # Captions through a word-level tokenizers JSON that the export carries (tokenizer.json, as DALL-E training
    # writes it): the MLflow model must carry it too.
    words = ["[UNK]", "a", "red", "blue", "circle", "square"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer_json = tok.to_str()
    vocab = HFTokenizer(tokenizer_json, source="test").vocab_size
    tiny = {"model.vocab_size": vocab, "dalle.text_seq_len": 8}
    train_and_register(registry, tmp_path, "dalle_x", 5.0, seed=2, recipe="dalle_shapes_debug", overrides=tiny,
                       files={"tokenizer.json": tokenizer_json})
    folder = resolve_export("models:/dalle_x@candidate", registry)
    assert (folder / "tokenizer.json").read_text() == tokenizer_json
    assert any(r.startswith("tokenizers==") for r in (folder.parent / "requirements.txt").read_text().split())
    model = mlflow.pyfunc.load_model("models:/dalle_x@candidate")
    rows = [{"prompt": "a red circle", "seed": 1}, {"prompt": "a blue square", "seed": 2, "cond_scale": 2.0}]
    got = model.predict(rows)
    gen = DalleGenerator.load("models:/dalle_x@candidate", tracking_uri=registry)
    assert gen.tokenizer.vocab_size == vocab < 257  # the word tokenizer, not bytes
    for row, b64 in zip(rows, got["image"]):
        png = base64.b64decode(b64)
        image = Image.open(io.BytesIO(png))
        assert image.format == "PNG" and image.size == (gen.image_size, gen.image_size) == (32, 32)
        drawn = gen.generate([row["prompt"]], num_images=1, seed=row["seed"], cond_scale=row.get("cond_scale", 1.0))
        assert png == png_bytes(drawn[0])  # what efftx.generate_images draws with that seed
    assert no_network == []


def test_a_dvae_export_reconstructs_images(tmp_path):
    import mlflow

    from efftx import mlflow_model
    from efftx.generation.png import png_bytes

    cfg = recipes.get("dvae_shapes_debug")
    torch.manual_seed(0)
    dvae = build_model(cfg).eval()
    out = export(dvae, cfg, tmp_path / "export", {})
    model = mlflow.pyfunc.load_model(str(mlflow_model.save(out, tmp_path / "model")))
    image = torch.rand(cfg.vae.channels, cfg.vae.image_size, cfg.vae.image_size)
    got = model.predict([{"image": base64.b64encode(png_bytes(image)).decode()}])["image"]
    with torch.no_grad():
        expected = dvae.reconstruct(torch.round(image * 255)[None] / 255)[0]
    assert base64.b64decode(got[0]) == png_bytes(expected)


# ------------------------------------------------------------------------------------------- promote

def test_promote_moves_the_champion_only_to_a_version_no_worse(registry, tmp_path, capsys):
    name = "promo"  # val_bpb (lower is better): 2.0, then a worse 2.5, then a better 1.5
    for seed, value in ((0, 2.0), (1, 2.5), (2, 1.5)):
        train_and_register(registry, tmp_path, name, value, seed=seed)
    uri = ["--tracking-uri", registry]

    assert promote.main([name, "1", *uri]) == 0  # no champion yet
    assert capsys.readouterr().out.startswith("promoted promo version 1 to @champion: there was no @champion")
    assert champion(registry, name) == "1"

    assert promote.main([name, "2", *uri]) == 1  # worse: refused, both values said
    line = capsys.readouterr().out
    assert line.startswith("refused: promo version 2") and "val_bpb 2.5 is worse than val_bpb 2 of version 1" in line
    assert champion(registry, name) == "1"

    assert promote.main([name, "candidate", *uri]) == 0  # the last run's version, better
    assert "val_bpb 1.5 vs val_bpb 2 of version 1" in capsys.readouterr().out
    assert champion(registry, name) == "3"
    assert read_export_config(resolve_export(f"models:/{name}@champion", registry))[1]["val_bpb"] == 1.5

    assert promote.main([name, "2", "--force", "--json", *uri]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["action"], result["forced"], result["previous"]) == ("promoted", True, "3")
    assert (result["candidate_value"], result["champion_value"], result["mode"]) == (2.5, 1.5, "min")
    assert champion(registry, name) == "2"
    assert read_export_config(resolve_export(f"models:/{name}@champion", registry))[1]["val_bpb"] == 2.5  # moved

    assert promote.main([name, "2", *uri]) == 0
    assert "already @champion" in capsys.readouterr().out


def test_promote_errors_name_what_is_missing(registry, tmp_path, capsys):
    train_and_register(registry, tmp_path, "errs", None, seed=0, plain=True)  # no metric at all
    uri = ["--tracking-uri", registry]
    assert promote.main(["nope", "1", *uri]) == 2
    assert "error: the registry has no model 'nope' (registered: " in capsys.readouterr().err
    assert promote.main(["errs", "7", *uri]) == 2
    assert "errs has no version 7 (versions: 1; aliases: candidate)" in capsys.readouterr().err
    assert promote.main(["errs", "best", *uri]) == 2
    assert "errs has no alias @best" in capsys.readouterr().err
    missing = tmp_path / "none.db"
    assert promote.main(["errs", "1", "--tracking-uri", f"sqlite:///{missing}"]) == 2
    assert "no MLflow database at" in capsys.readouterr().err and not missing.exists()
    assert promote.main(["errs", "1", *uri]) == 0  # no champion: promoted even without a metric
    proc = subprocess.run([sys.executable, "-m", "efftx.promote", "errs", "9", *uri], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert (proc.returncode, proc.stdout) == (2, "") and "errs has no version 9" in proc.stderr


# ------------------------------------------------------------------------------------------- old versions

def test_versions_registered_as_plain_folders_still_resolve(registry, tmp_path):
    """tests/data/export_v0 (a frozen export of efftx 58d3835) registered the old way, then a new version: every
    URI form resolves to the right export folder, and the old one still computes its recorded logits."""
    v0 = shutil.copytree(REPO / "tests" / "data" / "export_v0", tmp_path / "export_v0")
    cfg = read_export_config(v0)[0].override({"name": "v0", "tracking.uri": registry, "tracking.model_name": "old"})
    tracker = Tracker(cfg)
    tracker.log_artifacts(str(v0), "export")
    assert tracker.register("export") == "models:/old/1"
    train_and_register(registry, tmp_path, "old", 3.0, seed=5)
    client = client_for(registry)
    client.set_registered_model_alias("old", "champion", "1")
    for source, written_by in (("models:/old/1", "efftx 58d3835"), ("models:/old@champion", "efftx 58d3835"),
                               ("models:/old/latest", None), ("models:/old@candidate", None), ("models:/old/2", None)):
        assert read_export_config(resolve_export(source, registry))[1].get("written_by") == written_by, source
    model, _, _ = load_export(resolve_export("models:/old/1", registry))
    expected = json.loads((v0 / "expected.json").read_text())
    with torch.no_grad():
        logits = model(torch.tensor(expected["tokens"]))
    assert logits.double().sum().item() == pytest.approx(expected["logits_sum"], rel=1e-6)


def test_serving_what_is_not_registered_says_what_is_missing_and_how_to_train_it(registry, tmp_path):
    """A fresh registry (what `serve run serve/text.yaml` meets on a new checkout): the error names the model and
    the job that trains it; a model trained but never promoted: the error says how to promote it."""
    with pytest.raises(ExportError) as info:
        resolve_export("models:/spec_target_small@champion", registry)
    assert "has no model 'spec_target_small'; train it with: python jobs/train_speculative.py --size small" in \
        str(info.value)
    with pytest.raises(ExportError, match="'dalle_shapes_small'; train it with: python jobs/train_dalle.py --recipe "
                                          "dalle_shapes_small"):
        resolve_export("models:/dalle_shapes_small@champion", registry)
    with pytest.raises(ExportError) as info:
        resolve_export("models:/my_own_name/latest", registry)  # no recipe of that name: no command to suggest
    assert str(info.value).endswith("has no model 'my_own_name'")  # (nothing else registered: no model ids)
    train_and_register(registry, tmp_path, "unpromoted", 2.0, seed=0)
    with pytest.raises(ExportError) as info:
        resolve_export("models:/unpromoted@champion", registry)
    assert ("unpromoted has versions 1 but no @champion (aliases: @candidate); promote one with: "
            "python -m efftx.promote unpromoted candidate") in str(info.value)
    assert resolve_export("models:/unpromoted@candidate", registry).is_dir()
