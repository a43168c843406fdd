"""Distillation (distill.*): a student trained on a frozen teacher's distribution (DistillSpec). The KL term,
its mixing with the next-token loss, the teacher checks, the real train path, and that a distilled draft raises
acceptance against its teacher but never changes speculative decoding's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from efftx import recipes
from efftx.errors import ConfigError
from efftx.export import export
from efftx.generation.decode import generate
from efftx.generation.speculative import speculative_generate
from efftx.models import build as build_model
from efftx.train.tasks import LMTask, distill_kl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def student_cfg(tmp_path, **overrides):
    return recipes.get("spec_draft_debug").override({"data.cache_dir": str(tmp_path / "cache"), "name": "student",
                                                      **overrides})


def exported(tmp_path, name: str, seed: int, recipe: str = "spec_target_debug", **overrides):
    """A randomly initialised model of ``recipe`` exported to tmp_path/name; returns (folder, model)."""
    cfg = recipes.get(recipe).override(overrides)
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    return str(export(model, cfg, tmp_path / name, {})), model


def task_for(cfg) -> LMTask:
    return LMTask(cfg, LMTask.prepare(cfg))


# ------------------------------------------------------------------------------------------------ the loss

def test_kl_is_the_forward_kl_per_token_and_zero_for_the_teacher_itself():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g) * 3
    assert distill_kl(t, t).item() == pytest.approx(0.0, abs=1e-7)
    for temp in (1.0, 2.0):
        p, q = (t / temp).softmax(-1), (s / temp).softmax(-1)
        by_hand = (p * (p.log() - q.log())).sum(-1).mean() * temp ** 2  # KL(teacher || student), per token
        assert distill_kl(s, t, temp).item() == pytest.approx(by_hand.item(), rel=1e-5)
    # forward, not reverse: the two directions differ on these logits
    assert distill_kl(s, t).item() != pytest.approx(distill_kl(t, s).item(), rel=1e-2)


def test_kl_term_is_zero_when_the_student_is_the_teacher(tmp_path):
    folder, teacher = exported(tmp_path, "teacher", 0, recipe="spec_draft_debug")
    cfg = student_cfg(tmp_path, **{"distill.teacher": folder})
    task = task_for(cfg)
    batch = task.train_batch(0, 0, 0)
    loss, metrics = task.loss(teacher, batch)  # the student is the teacher
    assert metrics["distill_kl"].item() == pytest.approx(0.0, abs=1e-6)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # alpha 1: the KL alone
    plain, _ = task_for(student_cfg(tmp_path)).loss(teacher, batch)
    assert metrics["distill_ce"].item() == pytest.approx(plain.item(), rel=1e-6)  # the CE part is the usual loss


def test_loss_mixes_kl_and_next_token_loss_and_the_teacher_stays_frozen(tmp_path):
    folder, _ = exported(tmp_path, "teacher", 0)
    cfg = student_cfg(tmp_path, **{"distill.teacher": folder, "distill.alpha": 0.3, "distill.temperature": 2.0})
    task = task_for(cfg)
    torch.manual_seed(5)
    student = build_model(cfg)
    batch = task.train_batch(0, 0, 0)
    loss, m = task.loss(student, batch)
    assert m["distill_kl"].item() > 0.01
    assert loss.item() == pytest.approx(0.3 * m["distill_kl"].item() + 0.7 * m["distill_ce"].item(), rel=1e-5)
    x = batch[:, :-1]
    with torch.no_grad():
        expected = distill_kl(student(x), task._teacher(x.device)(x), 2.0)
    assert m["distill_kl"].item() == pytest.approx(expected.item(), rel=1e-5)  # the teacher sees the same batch
    loss.backward()
    teacher = task._teacher(x.device)
    assert not teacher.training and all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    assert task._teacher(x.device) is teacher  # loaded once per worker
    # validation reports the next-token loss (comparable with plain runs) and the KL to the teacher
    metrics, n = task.evaluate(student, task.eval_batches(0, 1))
    assert n > 0 and metrics["val_kl"] > 0.01 and set(metrics) == {"val_loss", "val_bpb", "val_kl"}


# ------------------------------------------------------------------------------------------------ checks

def test_a_teacher_with_another_vocabulary_is_rejected_naming_the_key(tmp_path):
    folder, _ = exported(tmp_path, "teacher", 0, **{"model.vocab_size": 100})
    with pytest.raises(ConfigError, match=r"distill\.teacher=.*vocabulary of 100.*must be the same"):
        LMTask.prepare(student_cfg(tmp_path, **{"distill.teacher": folder}))


def test_other_bad_teachers_are_rejected_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"distill\.teacher=.*nope.*not an efftx export"):
        LMTask.prepare(student_cfg(tmp_path, **{"distill.teacher": str(tmp_path / "nope")}))
    short, _ = exported(tmp_path, "short", 0, **{"model.max_seq_len": 32, "data.seq_len": 32})
    with pytest.raises(ConfigError, match=r"distill\.teacher=.*max_seq_len.*data\.seq_len=64"):
        LMTask.prepare(student_cfg(tmp_path, **{"distill.teacher": short}))


def test_a_relative_teacher_path_reaches_workers_that_run_elsewhere(tmp_path, monkeypatch):
    """`--target .efftx/runs/.../export` (relative to the driver's directory): the driver hands the workers the
    folder it checked, absolute, and a worker whose working directory is another one loads that teacher."""
    folder, teacher = exported(tmp_path, "teacher", 0)
    monkeypatch.chdir(tmp_path)
    cfg = student_cfg(tmp_path, **{"distill.teacher": "teacher"})
    prepared = LMTask.prepare(cfg)
    assert prepared["teacher_export"] == str((tmp_path / "teacher").resolve())
    (tmp_path / "worker").mkdir()
    monkeypatch.chdir(tmp_path / "worker")  # Ray Train's workers run in a directory of their own
    loaded = LMTask(cfg, prepared)._teacher(torch.device("cpu"))
    for a, b in zip(loaded.state_dict().values(), teacher.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("assignment, expected", [
    ({"distill.teacher": "x", "distill.alpha": 1.5}, "distill.alpha must be in"),
    ({"distill.teacher": "x", "distill.temperature": 0}, "distill.temperature must be > 0"),
    ({"distill.alpha": 0.5}, "apply with distill.teacher"),
])
def test_distill_keys_are_validated(assignment, expected):
    with pytest.raises(ConfigError, match=expected):
        recipes.get("spec_draft_debug").override({"name": "x", **assignment}).validate()


# ------------------------------------------------------------------------------------------------ behaviour

def train_student(task, steps: int, seed: int = 3):
    """A few Adam steps of ``task.loss`` on the task's own batches (in process, no Ray)."""
    torch.manual_seed(seed)
    student = build_model(task.cfg)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    for step in range(steps):
        loss, _ = task.loss(student, task.train_batch(step, 0, 0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return student.eval()


def test_a_distilled_draft_raises_acceptance_and_never_changes_outputs(tmp_path):
    """A random teacher on real text: the plain draft learns the text, the distilled one the teacher, so the
    distilled draft's drafts are accepted far more often; greedy speculative output is the teacher's own either
    way (and identical between the two drafts)."""
    folder, teacher = exported(tmp_path, "teacher", 0, **{"model.depth": 2})
    with torch.no_grad():  # a peaky teacher: its greedy choices are far from the text's
        for p in teacher.parameters():
            p.mul_(1.5)
    export(teacher, recipes.get("spec_target_debug").override({"model.depth": 2}), folder, {})
    plain = train_student(task_for(student_cfg(tmp_path)), 60)
    distilled = train_student(task_for(student_cfg(tmp_path, **{"distill.teacher": folder})), 60)
    task = task_for(student_cfg(tmp_path))
    prompts = task.data.val_windows(3, 16)[:, :16]
    base = generate(teacher, prompts, 40, temperature=0).tolist()
    acceptance = {}
    for name, draft in (("plain", plain), ("distilled", distilled)):
        out, stats = speculative_generate(teacher, draft, prompts, 40, gamma=4, temperature=0)
        assert out == base, name
        acceptance[name] = stats.mean_accepted
        sampled, st = speculative_generate(teacher, draft, prompts, 40, gamma=4, temperature=1.0, seed=0)
        assert [len(r) for r in sampled] == [40] * 3 and sum(st.histogram) == st.steps
    assert acceptance["distilled"] > acceptance["plain"] + 0.5, acceptance  # seen: 0.0 plain, 1.18 distilled


# ------------------------------------------------------------------------------------------------ real path

def test_final_speculative_measurement_and_the_target_flag(tmp_path, capsys):
    """What --distill runs after the draft: the target's sample against the draft, and a greedy equality check;
    --target without --distill is refused."""
    from efftx.cli import final_speculative_measurement, train_speculative_main

    target, _ = exported(tmp_path, "target", 0, **{"data.cache_dir": str(tmp_path / "cache")})
    draft, _ = exported(tmp_path, "draft", 1, recipe="spec_draft_debug")
    metrics = final_speculative_measurement(target, draft, None)
    assert metrics["spec_greedy_equal"] == 1.0 and 0 <= metrics["spec_mean_accepted"] <= 5
    assert {"decode_base_ms", "decode_spec_ms", "spec_speedup"} <= set(metrics)
    assert train_speculative_main(["--size", "debug", "--target", target]) == 2
    assert "--target names the teacher of a distilled draft" in capsys.readouterr().err


@pytest.mark.slow
def test_distilled_draft_through_the_real_train_path(ray_cluster, tmp_path):
    """jobs/train_speculative.py --distill: the target, then a draft distilled from it through Ray Train +
    DeepSpeed (short runs), both loss parts logged to MLflow, then the final speculative measurement of the target
    against the distilled draft (greedy output equal to base), logged to the target's run."""
    from mlflow import MlflowClient

    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    cmd = [sys.executable, "jobs/train_speculative.py", "--size", "debug", "--distill", "--run-name", "distilled",
           "--set", "train.steps=10", "--set", "train.eval_every=10", "--set", "train.sample_every=10",
           "--set", "train.log_every=5", "--set", "train.checkpoint_every=10", "--draft-set", "distill.alpha=0.5"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["speculative"]["spec_greedy_equal"] == 1.0
    assert 0 <= out["speculative"]["spec_mean_accepted"] <= 5
    draft, target = out["draft"], out["target"]
    client = MlflowClient(tracking_uri=draft["tracking_uri"])
    history = {key: {m.step: m.value for m in client.get_metric_history(draft["mlflow_run_id"], key)}
               for key in ("distill_kl", "distill_ce", "loss", "val_kl", "distill_mean_accepted")}
    assert all(history.values()), history
    assert sorted(history["distill_kl"]) == sorted(history["distill_ce"]) == [5, 10]  # every train.log_every
    for step, kl in history["distill_kl"].items():  # the loss is the mix of the two parts
        assert history["loss"][step] == pytest.approx(0.5 * kl + 0.5 * history["distill_ce"][step], rel=1e-4)
    params = client.get_run(draft["mlflow_run_id"]).data.params
    assert params["distill.teacher"] == target["export_path"] and params["distill.alpha"] == "0.5"
    # the target's speculative measurement ran once, after the draft, at the target's final step
    for key in ("spec_mean_accepted", "spec_greedy_equal", "spec_speedup"):
        assert [m.step for m in client.get_metric_history(target["mlflow_run_id"], key)] == [10], key
    assert client.get_run(target["mlflow_run_id"]).data.params["speculative.draft"] == ""
