"""Ray Train checkpoints: what a run resumes from.

A checkpoint is one Ray Train checkpoint folder ``<run>/checkpoint_<step>_<stamp>`` into which every rank
writes its DeepSpeed files (Ray merges the ranks' files); rank 0 adds ``efftx_state.json``: the loop state
and the full run config, so a checkpoint alone is enough to rebuild its model. Once every rank's upload has
returned, rank 0 writes ``efftx_manifest.json`` last (temp file + rename): every file's name, size and
SHA-256, hashed from the files each rank saved before the upload. A folder without a manifest, or whose files
do not match it, is not a checkpoint.

Resume does not trust Ray's bookkeeping alone: Ray Train learns of reports by polling, so when a driver or
worker dies the newest checkpoint on disk can be newer than the newest one Ray committed. :func:`restore`
scans the run folder itself (plus ``ray.train.get_checkpoint()``), verifies the manifests newest step first,
and loads the first intact one; only then does DeepSpeed unpickle its files. :func:`prune` removes checkpoint
folders Ray does not track beyond ``train.keep_checkpoints`` (never the one resumed from, never Ray's own).

Exports (what generation and Serve load) live in :mod:`efftx.export`, which imports no training code.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from efftx.errors import EfftxError
from efftx.export import atomic_write

STATE_FILE = "efftx_state.json"
MANIFEST_FILE = "efftx_manifest.json"
MANIFEST_FORMAT = "efftx-checkpoint-manifest/1"
CHECKPOINT_PREFIX = "checkpoint_"
DS_TAG = "deepspeed"

Log = Callable[[str], None]


# ------------------------------------------------------------------ manifests

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(folder: str | Path) -> dict[str, dict[str, Any]]:
    """``{relative posix path: {"size": bytes, "sha256": hex}}`` of every file under ``folder``."""
    root = Path(folder)
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(root.rglob("*")) if p.is_file()}


def write_manifest(folder: str | Path, files: dict[str, dict[str, Any]], step: int, world_size: int) -> Path:
    """Write ``efftx_manifest.json`` into a checkpoint folder (the last file of a checkpoint)."""
    manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": world_size, "created_ns": time.time_ns(),
                "files": dict(sorted(files.items()))}
    path = Path(folder) / MANIFEST_FILE
    atomic_write(path, json.dumps(manifest, indent=1))
    return path


def read_manifest(folder: str | Path) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") or (None, why it is unusable): cheap, reads only the manifest."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None, f"it has no {MANIFEST_FILE} (the save did not finish)"
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
            return None, f"{MANIFEST_FILE} is not an efftx manifest"
        int(manifest["step"])
        return manifest, ""
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{MANIFEST_FILE} is unreadable ({exc})"


def verify(folder: str | Path, hashes: bool = True) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") when every file the manifest lists is present with its size and (``hashes``) SHA-256,
    and the loop state is listed; else (None, the first problem, naming the file)."""
    manifest, problem = read_manifest(folder)
    if manifest is None:
        return None, problem
    if STATE_FILE not in manifest["files"]:
        return None, f"{MANIFEST_FILE} does not list {STATE_FILE}"
    root = Path(folder)
    for name, want in manifest["files"].items():
        path = root / name
        if not path.is_file():
            return None, f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return None, f"{name} is {size} bytes, its manifest says {want['size']} (torn or truncated)"
    for name, want in manifest["files"].items() if hashes else ():
        if _sha256(root / name) != want["sha256"]:
            return None, f"{name} does not match its SHA-256 in the manifest (corrupt)"
    return manifest, ""


def merge_digests(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One file table from every rank's: a file two ranks both wrote must be the same bytes."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, files in enumerate(per_rank):
        for name, digest in files.items():
            if name in merged and merged[name] != digest:
                raise EfftxError(f"checkpoint file {name} was written differently by two ranks (rank {rank} "
                                 f"and an earlier one): the merged checkpoint would be inconsistent")
            merged[name] = digest
    return merged


# ------------------------------------------------------------------ choosing and pruning checkpoints

@dataclass
class Found:
    """A checkpoint folder of a run, by the step its manifest names (-1: no usable manifest)."""
    path: Path
    step: int
    created_ns: int
    problem: str = ""  # why it is not usable ("" = not known to be bad)


def scan(run_dir: str | Path, extra: list[str | Path] = ()) -> list[Found]:
    """Every checkpoint folder of the run (``checkpoint_*`` under ``run_dir``, plus ``extra``), newest
    manifest step first; only the manifests are read."""
    root = Path(run_dir)
    folders = {p.resolve() for p in root.glob(CHECKPOINT_PREFIX + "*") if p.is_dir()} if root.is_dir() else set()
    folders |= {Path(p).resolve() for p in extra if Path(p).is_dir()}
    found = []
    for folder in folders:
        manifest, problem = read_manifest(folder)
        found.append(Found(folder, int(manifest["step"]), int(manifest.get("created_ns", 0)), "")
                     if manifest else Found(folder, -1, 0, problem))
    return sorted(found, key=lambda f: (f.step, f.created_ns, f.path.name), reverse=True)


def choose(found: list[Found], log: Log) -> Found | None:
    """The newest checkpoint whose files match its manifest (verified newest first; the bad ones are
    logged with the file that is bad and marked in ``found``)."""
    for f in found:
        if f.problem:
            log(f"checkpoint {f.path.name} is not usable: {f.problem}")
            continue
        manifest, problem = verify(f.path)
        if manifest is not None:
            return f
        f.problem = problem
        log(f"checkpoint {f.path.name} (step {f.step}) is not intact: {problem}; trying an older one")
    return None


def prune(found: list[Found], keep: int, tracked: set[Path], pinned: Path | None, log: Log) -> list[Path]:
    """Delete the checkpoint folders that Ray does not track (``tracked``: Ray keeps and deletes those itself,
    and a tracked folder that vanished would break Ray's restore) and that are not among the newest ``keep``
    usable ones by step, nor ``pinned`` (the one being resumed from). Returns the removed folders."""
    tracked = {Path(p).resolve() for p in tracked}
    usable = [f for f in found if not f.problem]
    kept = {f.path for f in usable[:max(1, keep)]} | ({Path(pinned).resolve()} if pinned else set())
    removed = []
    for f in found:
        if f.path in kept or f.path in tracked or not f.path.name.startswith(CHECKPOINT_PREFIX):
            continue
        why = f"step {f.step}, older than the newest {keep} kept" if not f.problem else f.problem
        shutil.rmtree(f.path, ignore_errors=True)
        removed.append(f.path)
        log(f"removed orphaned checkpoint {f.path.name} ({why})")
    return removed


# ------------------------------------------------------------------ collectives (JSON, no pickle)

def _dist_device():
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def broadcast_json(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (JSON-encoded bytes in a tensor)."""
    import torch.distributed as dist

    if not _dist_ready():
        return obj
    dev = _dist_device()
    data = json.dumps(obj).encode() if dist.get_rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(n, 0)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    if dist.get_rank() == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    import torch.distributed as dist

    if not _dist_ready():
        return [obj]
    dev, world = _dist_device(), dist.get_world_size()
    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(s.item())].cpu().tolist()).decode()) for b, s in zip(bufs, sizes)]


# ------------------------------------------------------------------ save / restore in the train loop

def _ray_tracked() -> tuple[set[Path], Path | None]:
    """(folders of the checkpoints Ray Train has committed, the one ``get_checkpoint()`` offers)."""
    import ray.train

    current = ray.train.get_checkpoint()
    reported = ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
    tracked = {Path(r.checkpoint.path) for r in reported}
    if current is not None:
        tracked.add(Path(current.path))
    return tracked, (Path(current.path) if current is not None else None)


def save(engine, state: dict[str, Any], metrics: dict[str, Any], rank: int, run_dir: str | Path,
         log: Log = lambda _: None) -> Path:
    """Collective: every rank saves its DeepSpeed files into one Ray Train checkpoint; once every rank's
    upload has returned, rank 0 writes the manifest (the last file). Returns the checkpoint folder."""
    import ray.train

    step = int(state["step"])
    name = broadcast_json(f"{CHECKPOINT_PREFIX}{step:08d}_{time.strftime('%Y%m%d-%H%M%S')}_{secrets.token_hex(3)}"
                          if rank == 0 else None)
    with tempfile.TemporaryDirectory(prefix="efftx-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=DS_TAG)
        if rank == 0:
            Path(tmp, STATE_FILE).write_text(json.dumps(state, indent=2))
        files = file_digests(tmp)  # what this rank meant to write, hashed before the upload
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    every_rank = all_gather_json(files)  # also a barrier: every rank's upload has returned
    folder = Path(run_dir) / name
    if rank == 0:
        if not folder.is_dir():
            raise EfftxError(f"checkpoint folder {folder} is not visible from rank 0: scaling.storage_path must be "
                             f"a folder every node shares")
        write_manifest(folder, merge_digests(every_rank), step, len(every_rank))
        log(f"checkpoint saved at step {step}: {folder}")
    return folder


def restore(engine, rank: int, run_dir: str | Path, keep: int, log: Log = lambda _: None) -> dict[str, Any] | None:
    """Collective: load the newest intact checkpoint of this run into ``engine``; return its loop state
    (None: nothing to resume). Rank 0 chooses among the run folder's checkpoints and Ray's by manifest
    step, verifies the files against the manifest before DeepSpeed unpickles any of them, removes orphaned
    folders (:func:`prune`) and tells the other ranks which one it chose."""
    chosen = None
    if rank == 0:
        tracked, current = _ray_tracked()
        found = scan(run_dir, extra=[current] if current else [])
        best = choose(found, log)
        if best is None and found:
            log(f"none of the {len(found)} checkpoint folders of this run is intact: starting from step 0")
        elif best is not None:
            ray_latest = next((f for f in found if current and f.path == current.resolve()), None)
            ray_note = ("latest: none" if ray_latest is None else f"latest is step {ray_latest.step}"
                        if ray_latest.step >= 0 else f"latest, {ray_latest.path.name}, has no usable manifest")
            log(f"resuming from checkpoint {best.path} (step {best.step}, files match its manifest; "
                f"Ray Train's {ray_note})")
        prune(found, keep, tracked, best.path if best else None, log)
        chosen = str(best.path) if best else None
    chosen = broadcast_json(chosen)
    if chosen is None:
        return None
    state = json.loads(Path(chosen, STATE_FILE).read_text())
    load_path, _ = engine.load_checkpoint(chosen, tag=DS_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {chosen}")
    from efftx.train.engine import replay_cpu_adam_steps

    replay_cpu_adam_steps(engine)
    return state


def prune_after_run(run_dir: str | Path, keep: int, log: Log = lambda _: None) -> list[Path]:
    """Rank 0, after the last report: wait until Ray has committed it, then remove the orphaned folders (a
    run resumed from a checkpoint Ray never committed leaves that folder behind otherwise). Folders are
    ranked by manifest step after a size check (no hashing: nothing is loaded here)."""
    tracked, _ = _ray_tracked()
    found = scan(run_dir)
    for f in found:
        if not f.problem:
            f.problem = verify(f.path, hashes=False)[1]
    return prune(found, keep, tracked, None, log)


@contextmanager
def full_parameters(engine):
    """Make every parameter whole on every rank (ZeRO-3 partitions them); a no-op below stage 3."""
    if engine.zero_optimization_stage() != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        yield
