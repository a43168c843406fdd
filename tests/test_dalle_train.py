"""DALL-E training and jobs: the dVAE and DALL-E tasks, the plateau schedule, tuple batches in the loop,
image samples, the DALL-E job (dVAE first, then DALL-E through the 2-worker TorchTrainer + DeepSpeed loop),
and export -> python -m efftx.generate_images.

Tests marked slow start Ray: run them under the shared lock
(``flock /tmp/efftx-ray.lock python -m pytest tests/test_dalle_train.py``).
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from efftx import models, recipes
from efftx.config import Config
from efftx.errors import ConfigError, ExportError
from efftx.generation.png import grid, png_bytes
from efftx.export import export, load_export
from efftx.train.engine import Schedule
from efftx.train.launch import resolve
from efftx.train.loop import to_device
from efftx.train.tasks import DALLETask, DVAETask

REPO = Path(__file__).resolve().parents[1]


def png_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as img:
        assert img.format == "PNG"
        return img.size


# ------------------------------------------------------------------------------------------ loop pieces

def test_to_device_moves_tensors_in_tuples_lists_and_dicts():
    meta = torch.device("meta")
    batch = {"images": torch.zeros(2, 3), "temperature": 0.7, "pair": (torch.ones(1), [torch.ones(2), "tag"])}
    moved = to_device(batch, meta)
    assert moved["images"].device == meta and moved["temperature"] == 0.7
    assert isinstance(moved["pair"], tuple) and moved["pair"][0].device == meta
    assert isinstance(moved["pair"][1], list) and moved["pair"][1][0].device == meta and moved["pair"][1][1] == "tag"
    assert to_device(torch.arange(3), meta).device == meta  # the LM's plain tensor batch


def _optimizer(lr: float = 1e-3):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _plateau_cfg(**overrides) -> Config:
    return Config().override({"train.schedule": "plateau", "train.warmup_steps": 0, "train.lr": 1e-3, **overrides})


def test_plateau_schedule_cuts_lr_after_patience_evaluations_without_improvement():
    opt = _optimizer()
    sched = Schedule(opt, _plateau_cfg(**{"train.plateau_patience": 2, "train.plateau_cooldown": 0,
                                          "train.plateau_factor": 0.5}))
    lrs = []
    for value in [1.0, 0.8, 0.8, 0.81, 0.9, 0.9, 0.9, 0.9]:  # best 0.8 at eval 2, then no improvement
        sched.observe(value)
        lrs.append(opt.param_groups[0]["lr"])
    # evals 3, 4 are the 2 tolerated bad ones; the 3rd bad one (eval 5) cuts; 3 more bad ones cut again
    assert lrs == pytest.approx([1e-3] * 4 + [5e-4] * 3 + [2.5e-4])
    assert sched.get_last_lr()[0] == pytest.approx(2.5e-4)


def test_plateau_schedule_matches_torch_reduce_lr_on_plateau():
    """The rule is torch's ReduceLROnPlateau (mode min, relative threshold, cooldown, min_lr), evaluation by
    evaluation, on a noisy loss curve; and its state survives a checkpoint round trip."""
    cfg = _plateau_cfg(**{"train.plateau_patience": 3, "train.plateau_cooldown": 2, "train.plateau_factor": 0.5,
                          "train.plateau_min_lr": 1e-4, "train.plateau_threshold": 1e-3})
    ours, ref_opt = _optimizer(), _optimizer()
    sched = Schedule(ours, cfg)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, factor=0.5, patience=3, cooldown=2, min_lr=1e-4,
                                                     threshold=1e-3)
    rng, value, cuts = random.Random(0), 1.0, 0
    for i in range(120):
        value *= rng.choice([0.97, 0.9995, 1.0, 1.01, 1.02])
        ours.step()
        sched.step()
        cuts += sched.observe(value)
        ref.step(value)
        assert ours.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12), i
        if i == 60:  # resume from a checkpoint of this point: the new scheduler continues identically
            resumed_opt = _optimizer()
            resumed = Schedule(resumed_opt, cfg)
            resumed_opt.load_state_dict(ours.state_dict())
            resumed.load_state_dict(sched.state_dict())
            ours, sched = resumed_opt, resumed
    assert cuts >= 3 and ours.param_groups[0]["lr"] == pytest.approx(1e-4)  # cut down to the floor


def test_cosine_schedule_ignores_validation_losses():
    opt = _optimizer()
    sched = Schedule(opt, Config().override({"train.warmup_steps": 0, "train.steps": 10, "train.min_lr_ratio": 0.1}))
    assert not any(sched.observe(1.0) for _ in range(30))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3) and sched.state_dict().get("plateau") is None
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)


@pytest.mark.parametrize("key, value, match", [
    ("train.schedule", "step", "train.schedule must be one of cosine, plateau"),
    ("train.plateau_factor", "1.5", r"train.plateau_factor must be in \(0, 1\)"),
    ("train.plateau_patience", "-1", "train.plateau_patience must be >= 0"),
    ("dalle.sample_filter_thres", "2", r"dalle.sample_filter_thres must be in \[0, 1\]"),
    ("train.sample_filter_thres", "0.5", "config key 'train.sample_filter_thres' is now 'dalle.sample_filter_thres'"),
])
def test_schedule_and_sample_keys_are_validated(key, value, match):
    with pytest.raises(ConfigError, match=match):
        cfg = recipes.get("dvae_shapes_debug").override([f"{key}={value}"])
        cfg.name = "x"
        cfg.validate()


# ------------------------------------------------------------------------------------------ PNG grids

def test_grid_places_images_in_rows_with_captions_below():
    red = torch.zeros(3, 8, 8)
    red[0] = 1
    pic = grid([red] * 5, ["a red square"] * 5, columns=4, cell=32)
    assert pic.mode == "RGB" and pic.width == 4 * (32 + 4) + 4
    assert pic.getpixel((4 + 16, 4 + 16)) == (255, 0, 0)  # the first image, scaled to the 32px cell
    with_text = grid([red], ["a red square"], cell=32)
    assert with_text.height > grid([red], cell=32).height  # room for the caption
    assert png_size(png_bytes(pic)) == pic.size
    gray = png_bytes(torch.full((1, 4, 6), 0.5))
    with Image.open(io.BytesIO(gray)) as img:
        assert img.mode == "L" and img.size == (6, 4) and img.getpixel((0, 0)) == 128
    with pytest.raises(ValueError, match="captions"):
        grid([red, red], ["one"])


# ------------------------------------------------------------------------------------------ tasks without Ray

@pytest.fixture(scope="module")
def dvae_export(tmp_path_factory):
    """An (untrained) dvae_shapes_debug export and its resolved config."""
    cfg = resolve(recipes.get("dvae_shapes_debug").override({"name": "unit-dvae"}))
    torch.manual_seed(0)
    model = models.build(cfg)
    out = export(model, cfg, tmp_path_factory.mktemp("dvae") / "export", {"step": 0})
    return out, cfg, model


def test_dvae_task_batches_loss_evaluation_and_reconstruction_sample(dvae_export):
    _, cfg, model = dvae_export
    task = DVAETask(cfg, DVAETask.prepare(cfg))
    first, again, later = task.train_batch(3, 1, 0), task.train_batch(3, 1, 0), task.train_batch(39, 1, 0)
    assert torch.equal(first["images"], again["images"]) and first["images"].shape == (4, 3, 32, 32)
    assert first["temperature"] == pytest.approx(math.exp(-0.02 * 3))  # vae.temperature_anneal of the recipe
    assert later["temperature"] == 0.5  # annealed down to vae.temperature_min
    loss, metrics = task.loss(model.train(), first)
    assert torch.isfinite(loss) and metrics["temperature"] == first["temperature"]
    assert {"recon_loss", "kl", "perplexity", "dead_codes"} <= set(metrics)
    model.eval()
    mine, other = task.eval_batches(0, 2), task.eval_batches(1, 2)
    metrics, n = task.evaluate(model, mine)
    assert n == sum(b["images"].shape[0] for b in mine) and n + sum(b["images"].shape[0] for b in other) == 13
    assert set(metrics) == {"val_loss", "val_recon_loss", "val_kl", "val_perplexity", "val_dead_codes"}
    assert 1 <= metrics["val_perplexity"] <= 64 and 0 <= metrics["val_dead_codes"] < 64
    empty, weight = task.evaluate(model, [])  # a rank without validation images reports every key, weight 0
    assert weight == 0 and set(empty) == set(metrics)
    artifacts, _ = task.sample(model, 7)
    # 4 validation images beside their 4 reconstructions: one row of 8 cells of 96 px
    assert list(artifacts) == ["samples/step_000007.png"]
    width, _ = png_size(artifacts["samples/step_000007.png"])
    assert width == 8 * (96 + 4) + 4


def dalle_cfg(vae_path: str, **overrides) -> Config:
    return recipes.get("dalle_shapes_debug").override({"name": "unit-dalle", "dalle.vae_path": str(vae_path),
                                                        **overrides})


def test_dalle_configure_takes_the_dvae_and_tokenizer_from_their_sources(dvae_export, tmp_path):
    export, vae_cfg, vae_model = dvae_export
    cfg = dalle_cfg(export, **{"vae.num_tokens": 999, "model.vocab_size": 5})
    resolved = resolve(cfg)
    assert resolved.vae == vae_cfg.vae and resolved.model.vocab_size == 257  # the byte tokenizer, pad id 0
    task = DALLETask(resolved, DALLETask.prepare(resolved))
    torch.manual_seed(1)
    model = models.build(resolved)
    task.load_pretrained(model)
    assert torch.equal(model.vae.codebook.weight, vae_model.codebook.weight)
    assert not any(p.requires_grad for p in model.vae.parameters())
    images, text = task.train_batch(0, 0, 0)
    assert images.shape == (4, 3, 32, 32) and text.shape == (4, 64) and text.dtype == torch.long
    loss, metrics = task.loss(model, (images, text))
    assert torch.isfinite(loss) and {"loss_text", "loss_img"} <= set(metrics)
    assert task.tokens_per_micro_batch == 4 * (64 + 64)
    assert task.export_files() == {}  # bytes need no tokenizer file


@pytest.mark.parametrize("source, error, match", [
    ("", ConfigError, "dalle.vae_path is empty"),
    ("/no/such/export", ExportError, "dalle.vae_path: /no/such/export is not an efftx export"),
    ("models:/no-such-dvae/1", ExportError, "models:/no-such-dvae/1: the MLflow registry at .* has no model "
                                            "'no-such-dvae'"),
    ("models:/just-a-name", ExportError, "not a registered-model URI"),
])
def test_bad_vae_path_is_a_clear_error_at_configuration(source, error, match):
    with pytest.raises(error, match=match):
        resolve(dalle_cfg(source))


def test_vae_path_must_be_a_dvae(tmp_path):
    lm_cfg = resolve(recipes.get("lm_debug").override({"name": "lm"}))
    from efftx.train.tasks import LMTask

    out = export(models.build(lm_cfg), lm_cfg, tmp_path / "lm", {})
    with pytest.raises(ExportError, match="is a 'lm' export, not a dVAE"):
        resolve(dalle_cfg(out))


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """A word-level Hugging Face tokenizers JSON covering the shapes captions."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from efftx.data import shapes

    words = sorted({w for c in shapes.captions("all") for line in c.lines() for w in line.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "words.json"
    tok.save(str(path))
    return path


def _dalle_export(vae_export, tmp_path, **overrides):
    """A DALL-E export written as the loop writes it (with the task's files), and its task."""
    cfg = resolve(dalle_cfg(vae_export, **overrides))
    task = DALLETask(cfg, DALLETask.prepare(cfg))
    torch.manual_seed(2)
    model = models.build(cfg)
    task.load_pretrained(model)
    return export(model, cfg, tmp_path / "dalle", {"step": 0}, files=task.export_files()), cfg, model


def test_dalle_export_carries_its_tokenizer(dvae_export, word_tokenizer, tmp_path):
    from efftx.generation.text_to_image import DalleGenerator

    export, cfg, _ = _dalle_export(dvae_export[0], tmp_path, **{"data.image.bpe_path": str(word_tokenizer)})
    assert cfg.model.vocab_size < 257  # the word vocabulary + pad, not bytes
    assert (export / "tokenizer.json").is_file()
    word_tokenizer.rename(word_tokenizer.with_suffix(".moved"))  # the training machine's file is gone
    try:
        gen = DalleGenerator.load(str(export))
        ids, cut = gen.encode(["a red circle"])
        assert ids[0, :3].tolist() == [gen.tokenizer.encode(w)[0] for w in ("a", "red", "circle")] and cut == [False]
        assert gen.generate(["a red circle"], num_images=1, seed=0).shape == (1, 3, 32, 32)
    finally:
        word_tokenizer.with_suffix(".moved").rename(word_tokenizer)


def test_generate_images_cli_writes_pngs_and_a_grid(dvae_export, tmp_path):
    from efftx.generate_images import DalleGenerator, main

    export, _, model = _dalle_export(dvae_export[0], tmp_path)
    out = tmp_path / "out"
    args = ["--model", str(export), "--prompt", "a red circle", "--prompt", "a blue square on a white background",
            "--num-images", "3", "--batch-size", "2", "--seed", "4", "--out", str(out)]
    assert main(args) == 0
    files = sorted(out.rglob("*.png"))
    assert len(files) == 2 * 3 + 1 and (out / "grid.png").is_file()
    for path in (out / "a_red_circle").glob("*.png"):
        assert png_size(path.read_bytes()) == (32, 32)
    first = [(out / "a_red_circle" / f"{i}.png").read_bytes() for i in range(3)]
    gen = DalleGenerator.load(str(export))
    images = gen.generate(["a red circle"], num_images=3, batch_size=3, seed=4)
    assert [png_bytes(im) for im in images] == first  # the library draws what the CLI wrote, whatever the batch
    other = gen.generate(["a red circle"], num_images=3, seed=5)
    assert [png_bytes(im) for im in other] != first


@pytest.mark.parametrize("model, args, match", [
    ("/no/such/export", [], "not an efftx export"),
    ("dvae", [], "is a 'dvae' export, not a DALL-E"),
    ("dalle", ["--num-images", "0"], "num_images must be >= 1"),
    ("dalle", ["--filter-thres", "1.5"], r"filter_thres must be in \[0, 1\]"),
    ("dalle", ["--cond-scale", "nan"], "cond_scale must be a finite number"),
    ("dalle", ["--top-k", "0"], "--top-k must be >= 1"),
    ("dalle", ["--prompt", "  "], "every prompt must hold some text"),
])
def test_generate_images_bad_arguments_are_clear_errors(dvae_export, tmp_path, model, args, match, capsys):
    from efftx.generate_images import main

    model = {"dvae": lambda: dvae_export[0], "dalle": lambda: _dalle_export(dvae_export[0], tmp_path)[0]}.get(
        model, lambda: model)()
    assert main(["--model", str(model), "--prompt", "x", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(match, err), err
    assert not (tmp_path / "out").exists()


def test_dalle_job_configures_the_dvae_it_trains_first(capsys):
    from efftx.cli import train_dalle_main

    code = train_dalle_main(["--recipe", "dalle_shapes_debug", "--run-name", "cfg", "--print-config",
                             "--set", "data.image.shapes_n=100", "--set", "train.lr=0.01",
                             "--vae-set", "train.steps=7", "--workers", "1"])
    assert code == 0
    both = json.loads(capsys.readouterr().out)
    dvae, dalle = both["dvae"], both["dalle"]
    assert (dvae["name"], dalle["name"]) == ("cfg-dvae", "cfg-dalle") and dvae["recipe"] == "dvae_shapes_debug"
    assert dvae["data"]["image"]["shapes_n"] == dalle["data"]["image"]["shapes_n"] == 100  # data.*: both runs
    assert dalle["train"]["lr"] == 0.01 and dvae["train"]["lr"] != 0.01  # model/train keys: DALL-E only
    assert dvae["train"]["steps"] == 7 and dalle["train"]["steps"] == 40
    assert dvae["scaling"]["num_workers"] == dalle["scaling"]["num_workers"] == 1


@pytest.mark.parametrize("args, match", [
    (["--recipe", "lm_debug"], "trains model.family='lm', not a DALL-E"),
    (["--vae", "/x", "--vae-set", "train.steps=3"], "with --vae .* it trains none"),
    (["--recipe", "dalle_shapes_debug", "--vae-recipe", "nope"], "unknown recipe 'nope'"),
])
def test_dalle_job_argument_errors(args, match, capsys):
    from efftx.cli import train_dalle_main

    assert train_dalle_main(args) == 2
    assert re.search(match, capsys.readouterr().err)


# ------------------------------------------------------------------------------------------ through Ray

def mlflow_client(summary):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=summary["tracking_uri"], registry_uri=summary["tracking_uri"])


def history(summary, key) -> dict[int, float]:
    """step -> value of a metric (the last one logged, when a restart logged a step twice)."""
    return {step: values[-1] for step, values in all_history(summary, key).items()}


def all_history(summary, key) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for m in sorted(mlflow_client(summary).get_metric_history(summary["mlflow_run_id"], key), key=lambda m: m.timestamp):
        out.setdefault(m.step, []).append(m.value)
    return out


def run_job(ray_address: str | None, *args, timeout=600):
    """jobs/train_dalle.py on the cluster at ``ray_address`` (None: no cluster; the job would start its own)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run([sys.executable, "jobs/train_dalle.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dalle_job(ray_cluster):
    """jobs/train_dalle.py without --vae: dvae_shapes_debug, then dalle_shapes_debug on its export.

    The dVAE run also exercises the plateau schedule and its restore: with a threshold no evaluation can meet
    and patience 0, every evaluation after the first halves the lr; a worker fails at step 25 and Ray Train
    restarts the run from the step-20 checkpoint (taken after the cut of evaluation 20)."""
    plateau = ["train.schedule=plateau", "train.plateau_patience=0", "train.plateau_cooldown=0",
               "train.plateau_threshold=0.99", "train.fail_at_step=25", "train.max_failures=1"]
    proc = run_job(ray_cluster, "--recipe", "dalle_shapes_debug", "--run-name", "pair",
                   *[arg for key in plateau for arg in ("--vae-set", key)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


@pytest.mark.slow
def test_dalle_job_trains_the_dvae_then_dalle_with_falling_losses(dalle_job):
    both, stdout = dalle_job
    dvae, dalle = both["dvae"], both["dalle"]
    assert dvae["run_name"] == "pair-dvae" and dalle["run_name"] == "pair-dalle"
    assert dvae["final_step"] == dalle["final_step"] == 40
    for summary in (dvae, dalle):
        val = history(summary, "val_loss")
        assert sorted(val) == [0, 20, 40]
        assert val[40] < val[20] < val[0], val
        train = history(summary, "loss")
        assert sorted(train) == list(range(1, 41))
        assert sum(train[s] for s in range(31, 41)) < 0.8 * sum(train[s] for s in range(1, 11)), train
    assert history(dalle, "val_loss")[40] < 0.7 * history(dalle, "val_loss")[0]
    # the dVAE's Gumbel temperature anneals through the loop, and its codebook usage is tracked
    tau = history(dvae, "temperature")
    assert tau[5] == pytest.approx(math.exp(-0.02 * 4)) and tau[40] == 0.5
    for key in ("perplexity", "dead_codes", "val_perplexity", "val_dead_codes", "recon_loss"):
        assert history(dvae, key), key
    assert 1 < history(dvae, "val_perplexity")[40] <= 64
    for key in ("loss_text", "loss_img", "val_loss_img", "tokens_per_s", "mfu"):
        assert history(dalle, key), key
    assert "generate:       .venv/bin/python -m efftx.generate_images" in stdout


@pytest.mark.slow
def test_plateau_schedule_cuts_through_the_loop_and_is_restored_after_a_restart(dalle_job):
    both, stdout = dalle_job
    dvae = both["dvae"]
    lr = all_history(dvae, "lr")
    assert [v[-1] for s, v in sorted(lr.items())] == pytest.approx([3e-3] * 4 + [1.5e-3] * 4)  # cut at eval 20
    losses = all_history(dvae, "loss")
    assert [len(losses[s]) for s in range(20, 26)] == [1, 2, 2, 2, 2, 1]  # steps 21-24 ran twice (the restart)
    assert all(len(set(losses[s])) == 1 for s in losses)  # ... computing exactly the same losses
    assert stdout.count("learning rate cut to") == 2  # evaluations 20 and 40


@pytest.mark.slow
def test_dalle_job_logs_png_samples_and_registers_both_models(dalle_job):
    both, _ = dalle_job
    for role, size in (("dvae", (8 * (96 + 4) + 4, None)), ("dalle", (4 * (128 + 4) + 4, None))):
        summary = both[role]
        client = mlflow_client(summary)
        names = [a.path for a in client.list_artifacts(summary["mlflow_run_id"], "samples")]
        assert names == ["samples/step_000040.png"], names
        local = client.download_artifacts(summary["mlflow_run_id"], names[0])
        assert png_size(Path(local).read_bytes())[0] == size[0]
        recipe = f"{role}_shapes_debug"
        assert summary["registered_model"].startswith(f"models:/{recipe}/")
        assert any(v.run_id == summary["mlflow_run_id"] for v in client.search_model_versions(f"name='{recipe}'"))
    params = mlflow_client(both["dalle"]).get_run(both["dalle"]["mlflow_run_id"]).data.params
    assert params["dalle.vae_path"] == both["dvae"]["export_path"] and params["vae.num_tokens"] == "64"


@pytest.mark.slow
def test_dalle_export_holds_the_frozen_dvae_and_rebuilds_alone(dalle_job):
    from safetensors.torch import load_file

    both, _ = dalle_job
    vae_model, vae_cfg, _ = load_export(both["dvae"]["export_path"])
    model, cfg, _ = load_export(both["dalle"]["export_path"])  # the DALL-E export's config alone
    assert cfg.vae == vae_cfg.vae and cfg.model.family == "dalle"
    weights = load_file(str(Path(both["dalle"]["export_path"], "model.safetensors")))
    assert {k[len("vae."):] for k in weights if k.startswith("vae.")} == set(vae_model.state_dict())
    for name, value in vae_model.state_dict().items():  # frozen: the dVAE's weights, untouched by training
        assert torch.equal(model.vae.state_dict()[name], value), name


@pytest.mark.slow
def test_export_and_registered_model_generate_the_same_pngs(dalle_job, tmp_path):
    both, _ = dalle_job
    outputs = {}
    for label, model in (("path", both["dalle"]["export_path"]), ("registry", both["dalle"]["registered_model"])):
        cmd = [sys.executable, "-m", "efftx.generate_images", "--model", model, "--prompt",
               "a red circle on a blue background", "--num-images", "2", "--seed", "3", "--out", str(tmp_path / label)]
        env = {**os.environ, "MLFLOW_TRACKING_URI": both["dalle"]["tracking_uri"]}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        written = json.loads(proc.stdout.strip().splitlines()[-1])
        assert len(written["images"]) == 2 and Path(written["grid"]).is_file()
        outputs[label] = [Path(f).read_bytes() for f in written["images"]]
        assert all(png_size(data) == (32, 32) for data in outputs[label])
    assert outputs["path"] == outputs["registry"]


def test_job_with_a_bad_vae_fails_before_ray_starts(efftx_home):
    proc = run_job(None, "--recipe", "dalle_shapes_debug", "--vae", "/no/such/dvae", "--run-name", "bad-vae")
    assert proc.returncode == 2
    assert "error: dalle.vae_path: /no/such/dvae is not an efftx export" in proc.stderr
    assert "Traceback" not in proc.stderr and "image data" not in proc.stdout  # stopped before the data and Ray
    assert not (Path(efftx_home) / "runs" / "bad-vae-dalle").exists()
