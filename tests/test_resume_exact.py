"""Resume is bit-exact end to end, where it is easiest to get wrong: Performer feature redraws on both sides of
the resume point, its blocks activation-checkpointed (recomputed in backward, where the redraw counter must not
count; the recipe's reversible stack is off for it); Sinkhorn with attention and residual dropout (reversible
layers recompute under a replayed RNG) trained with ZeRO-2 and ZeRO-Offload in bf16 (fp32 master weights
partitioned and kept in host memory, stepped by DeepSpeed's CPU Adam), from a DeepSpeed config file of its own
(DeepSpeed's Adam by name, built by DeepSpeed, and WarmupLR still warming up across the resume point).

Each case trains once through the real path (Ray Train TorchTrainer, 2 workers, DeepSpeed on CPU, MLflow) with
an injected failure before step FAIL_AT (the Performer case raises in the worker, the other one kills the worker
process), after which Ray Train restarts the workers from the step-5 checkpoint, found in the run folder by its
manifest even when Ray Train had not yet polled its report. The steps between the checkpoint and the failure
therefore run twice, first from the live state and then from the restored one: their losses must be equal bit
for bit. Two re-run steps make the check cover both the restored forward state (first re-run step: weights, RNG,
redraw counter) and the restored optimizer state (second re-run step: it sees the first one's update, fp32
master weights and Adam moments included). A deliberately wrong restore (features redrawn from zero, an RNG not
restored, master weights rebuilt from bf16) changes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from efftx import recipes
from efftx.train.engine import lr_lambda
from efftx.train.launch import launch, resolve

pytestmark = pytest.mark.slow

STEPS, CHECKPOINT_EVERY, FAIL_AT = 9, 5, 8
# Performer: 2 training forward passes per step (train.grad_accum), features redrawn every 6 passes, i.e. at the
# start of steps 4 and 7: one redraw before the step-5 checkpoint, one between the resume and the failure (run
# twice).
REDRAW_PASSES = 6

# The Sinkhorn case brings its own DeepSpeed config (engine.deepspeed_config; the file wins): ZeRO-2 with the
# optimizer offloaded to the host (DeepSpeed's CPU Adam) and bf16, DeepSpeed's Adam by name (engine.optimizer=adam: L2 weight decay) with the seeds' betas / eps, and WarmupLR (log)
# warming up over 8 steps, so the re-run steps 6 and 7 run at learning rates only a restored schedule gives.
SINKHORN_DS_CONFIG = Path(os.environ["EFFTX_HOME"], "ds_config_sinkhorn.json")  # the tests' throwaway home
SINKHORN_DS_CONFIG.write_text(json.dumps({
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                             "adam_w_mode": False}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 8}},
}))

CASES = {
    "performer_redraws_actckpt": ("performer_debug", {"attention.performer.feature_redraw_interval": REDRAW_PASSES,
                                                      "model.reversible": False,
                                                      "model.activation_checkpointing": True}),
    "sinkhorn_dropout_zero2_offload_bf16": ("sinkhorn_debug", {"attention.dropout": 0.1, "model.dropout": 0.1,
                                                       "engine.deepspeed_config": str(SINKHORN_DS_CONFIG),
                                                       "train.fail_mode": "exit"}),
}


def case_cfg(case: str, name: str, **extra):
    recipe, overrides = CASES[case]
    return recipes.get(recipe).override({
        "name": name, "train.steps": STEPS, "train.checkpoint_every": CHECKPOINT_EVERY,
        "train.eval_every": STEPS, "train.log_every": STEPS, **overrides, **extra})


def history(summary, key="loss") -> dict[int, list[float]]:
    from mlflow import MlflowClient

    out: dict[int, list[float]] = {}
    for m in MlflowClient(tracking_uri=summary["tracking_uri"]).get_metric_history(summary["mlflow_run_id"], key):
        out.setdefault(m.step, []).append(m.value)
    return out


def final_module_state(summary) -> dict[str, torch.Tensor]:
    shard = Path(summary["checkpoint"], "deepspeed", "mp_rank_00_model_states.pt")
    return torch.load(shard, map_location="cpu", weights_only=False)["module"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_rerun_after_resume_equal_their_first_run_exactly(ray_cluster, case):
    resumed = launch(case_cfg(case, f"exact-{case}", **{"train.fail_at_step": FAIL_AT, "train.max_failures": 1}))
    assert resumed["final_step"] == STEPS
    got = history(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    # it resumed from the checkpoint (not from scratch): only the steps after it ran twice
    rerun = list(range(CHECKPOINT_EVERY + 1, FAIL_AT))
    assert [s for s in got if len(got[s]) > 1] == rerun
    for step in rerun:
        first, again = got[step]
        assert first == again, (step, first, again)
    run = Path(resumed["checkpoint"]).parent  # no orphaned checkpoint beyond train.keep_checkpoints (2)
    assert len([p for p in run.glob("checkpoint_*") if p.is_dir()]) == 2
    # the schedule's step count came back too: the learning rate logged at the last step is the schedule's there
    # (the re-run steps cannot show it: the optimizer state restores the current learning rate by itself)
    cfg = resolve(case_cfg(case, "lr-check"))
    assert history(resumed, "lr")[STEPS] == [pytest.approx(cfg.train.lr * lr_lambda(cfg)(STEPS))]
    if case == "sinkhorn_dropout_zero2_offload_bf16":  # the file's offload reached the run config and MLflow
        from mlflow import MlflowClient

        params = MlflowClient(tracking_uri=resumed["tracking_uri"]).get_run(resumed["mlflow_run_id"]).data.params
        assert (params["engine.offload_optimizer"], params["engine.zero_stage"]) == ("cpu", "2")
        # the export holds the fp32 masters (kept partitioned in host memory): each rounds to the engine's bf16
        # weight in the last checkpoint, and nearly none is a bf16 value itself (power: exporting the engine's
        # own weights, all are)
        from efftx.export import load_export

        model, _, _ = load_export(resumed["export_path"])
        engine = final_module_state(resumed)
        names = [name for name, p in model.named_parameters()]
        assert names and all(engine[n].dtype == torch.bfloat16 for n in names)
        exported = dict(model.named_parameters())
        for name in names:
            assert torch.equal(exported[name].detach().bfloat16(), engine[name]), name
        weights = torch.cat([exported[n].detach().flatten() for n in names])
        assert (weights.bfloat16().float() != weights).float().mean() > 0.9
    if case == "performer_redraws_actckpt":
        # every rank counted exactly the passes of the steps the run kept: the counter, and the features drawn
        # from it, came back from the checkpoint (not from zero, not from the failed attempt's extra passes)
        from efftx.attention.performer import PerformerAttention
        from efftx.models import build as build_model

        passes = STEPS * 2  # train.grad_accum = 2
        layers = [(name, mod) for name, mod in build_model(case_cfg(case, "x")).named_modules()
                  if isinstance(mod, PerformerAttention)]
        state = final_module_state(resumed)
        for name, mod in layers:
            assert int(state[f"{name}.calls"]) == passes, name
            assert torch.equal(state[f"{name}.projection"], mod.draw((passes - 1) // REDRAW_PASSES)), name
