"""ZeRO-Offload and activation checkpointing: memory and train-step time of one model, each combination side by side.

    python bench/zero_offload.py [--recipe lm_small] [--batch 8] [--steps 6] [--zero-stage 2] [--set key=value ...]

Each of the four combinations (offload_optimizer none/cpu x activation_checkpointing off/on) trains the same
model from the same seed for ``--steps`` optimizer steps through efftx's DeepSpeed engine
(:func:`efftx.train.engine.initialize`: one process, gloo, world size 1), each in a fresh process so its peak
memory is its own, in turn, round after round (``--rounds``; the medians are printed):
- step s: median seconds of one optimizer step (forward, backward, DeepSpeed step), after one warm-up step;
- peak MiB: the process's peak memory above what it held before the model was built (RSS on CPU; on CUDA the
  peak allocated on the GPU, where offload moves the optimizer states and fp32 master weights off the device);
- optimizer state MiB on the device: the Adam moments and fp32 master weights, by where they live.
Ratios are against the first row (no offload, no checkpointing). There is no goal: on a CPU-only machine the
"device" is host memory, so offload can only cost time; the figures say how much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, resource, socket, statistics, sys, time
import torch, torch.distributed as dist
import torch.nn.functional as F
from efftx import models, recipes
from efftx.train import engine as engine_lib

args = json.loads(sys.argv[1])
device = args["device"]
engine_lib.set_accelerator_env(device)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
cfg = recipes.get(args["recipe"]).override([*args["overrides"], "name=bench", "train.grad_accum=1",
                                            f"train.micro_batch_size={args['batch']}", f"scaling.device={device}",
                                            "scaling.num_workers=1", "model.reversible=false",
                                            f"engine.zero_stage={args['zero_stage']}",
                                            f"engine.offload_optimizer={args['offload']}",
                                            f"model.activation_checkpointing={args['ckpt']}"])
cfg.validate()


def rss():
    import psutil
    return psutil.Process().memory_info().rss


base = torch.cuda.memory_allocated() if device == "cuda" else rss()
torch.manual_seed(0)
model = models.build(cfg).to(device).train()
engine = engine_lib.initialize(model, cfg)[0]
x = torch.randint(0, cfg.model.vocab_size, (args["batch"], cfg.data.seq_len + 1),
                  generator=torch.Generator().manual_seed(1)).to(device)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
times, losses = [], []
for i in range(args["steps"] + 1):
    sync()
    t0 = time.perf_counter()
    logits = engine(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    sync()
    if i:
        times.append(time.perf_counter() - t0)
    losses.append(loss.item())
peak = (torch.cuda.max_memory_allocated() if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
on_device = sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
                if torch.is_tensor(t) and t.device.type == device and t.dim() > 0)
master = getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or []
on_device += sum(t.numel() * t.element_size() for t in master if t.device.type == device)
print("RESULT " + json.dumps({"step_s": statistics.median(times), "peak_mib": max(peak, 0) / 2**20,
                              "state_mib": on_device / 2**20, "optimizer": type(inner).__name__,
                              "loss": losses[-1], "params": model.num_params()}))
"""

COMBOS = [("none", False), ("cpu", False), ("none", True), ("cpu", True)]


def run_one(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "platform")}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=1200)
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise SystemExit(f"benchmark child failed ({spec}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="lm_small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    spec = {"recipe": args.recipe, "batch": args.batch, "steps": args.steps, "zero_stage": args.zero_stage,
            "device": args.device, "overrides": args.overrides}
    runs: dict[tuple, list[dict]] = {combo: [] for combo in COMBOS}
    for _ in range(args.rounds):  # in turn, round after round: a busy machine slows every combination alike
        for offload, ckpt in COMBOS:
            runs[(offload, ckpt)].append(run_one({**spec, "offload": offload, "ckpt": ckpt}))
    first = runs[COMBOS[0]][0]
    print(f"{args.recipe}: {first['params'] / 1e6:.2f}M params, batch {args.batch}, ZeRO-{args.zero_stage}, "
          f"{args.device}, {args.steps} timed steps x {args.rounds} rounds (medians)")
    rows = {combo: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "peak_mib", "state_mib")}
            for combo, rs in runs.items()}
    ref = rows[COMBOS[0]]
    print(f"{'offload':>8} {'act. ckpt':>9} {'optimizer':>17} {'step s':>8} {'x':>6} {'peak MiB':>9} {'x':>6} "
          f"{'opt. state MiB on ' + args.device:>24} {'final loss':>11}")
    for combo in COMBOS:
        r, one = rows[combo], runs[combo][0]
        print(f"{combo[0]:>8} {str(combo[1]).lower():>9} {one['optimizer']:>17} {r['step_s']:8.3f} "
              f"{r['step_s'] / ref['step_s']:6.2f} {r['peak_mib']:9.1f} {r['peak_mib'] / max(ref['peak_mib'], 1e-9):6.2f} "
              f"{r['state_mib']:24.1f} {one['loss']:11.5f}")


if __name__ == "__main__":
    main()
