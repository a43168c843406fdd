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

The run folder may be on any filesystem Ray supports (``scaling.storage_path``: a local folder, ``s3://...``):
every function here takes an optional :class:`efftx.storage.Storage` (None = local paths, as in the tests), and
paths are paths on its filesystem. On a remote storage the manifest is read and written there, sizes come from one
listing, the chosen checkpoint is downloaded once into a local temp folder, verified there against its manifest and
loaded by DeepSpeed from there.

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
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import torch

from efftx.errors import EfftxError
from efftx.storage import Storage

STATE_FILE = "efftx_state.json"
MANIFEST_FILE = "efftx_manifest.json"
MANIFEST_FORMAT = "efftx-checkpoint-manifest/1"
CHECKPOINT_PREFIX = "checkpoint_"
DS_TAG = "deepspeed"

Log = Callable[[str], None]


def _local() -> Storage:
    return Storage.local()


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


def write_manifest(folder: str | Path, files: dict[str, dict[str, Any]], step: int, world_size: int,
                   storage: Storage | None = None) -> Path:
    """Write ``efftx_manifest.json`` into a checkpoint folder (the last file of a checkpoint)."""
    manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": world_size, "created_ns": time.time_ns(),
                "files": dict(sorted(files.items()))}
    storage = storage or _local()
    path = f"{folder}/{MANIFEST_FILE}"
    storage.write(path, json.dumps(manifest, indent=1))
    return Path(path)


def read_manifest(folder: str | Path, storage: Storage | None = None) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") or (None, why it is unusable): cheap, reads only the manifest."""
    storage = storage or _local()
    path = f"{folder}/{MANIFEST_FILE}"
    if not storage.is_file(path):
        return None, f"it has no {MANIFEST_FILE} (the save did not finish)"
    try:
        manifest = json.loads(storage.read_text(path))
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
            return None, f"{MANIFEST_FILE} is not an efftx manifest"
        int(manifest["step"])
        return manifest, ""
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{MANIFEST_FILE} is unreadable ({exc})"


def verify(folder: str | Path, hashes: bool = True, storage: Storage | None = None) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") when every file the manifest lists is present with its size and (``hashes``) SHA-256,
    and the loop state is listed; else (None, the first problem, naming the file)."""
    storage = storage or _local()
    manifest, problem = read_manifest(folder, storage)
    if manifest is None:
        return None, problem
    if STATE_FILE not in manifest["files"]:
        return None, f"{MANIFEST_FILE} does not list {STATE_FILE}"
    sizes = storage.file_sizes(folder)  # one listing (one request per 1000 files on an object store)
    for name, want in manifest["files"].items():
        if name not in sizes:
            return None, f"{name} is missing"
        size = sizes[name]
        if size != want["size"]:
            return None, f"{name} is {size} bytes, its manifest says {want['size']} (torn or truncated)"
    for name, want in manifest["files"].items() if hashes else ():
        if storage.sha256(f"{folder}/{name}") != want["sha256"]:
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
    path: Path  # a PurePosixPath on a remote storage
    step: int
    created_ns: int
    problem: str = ""  # why it is not usable ("" = not known to be bad)
    local: Path | None = None  # a verified local copy (remote storage: what DeepSpeed loads)


def scan(run_dir: str | Path, extra: list[str | Path] = (), storage: Storage | None = None) -> list[Found]:
    """Every checkpoint folder of the run (``checkpoint_*`` under ``run_dir``, plus ``extra``), newest
    manifest step first; only the manifests are read."""
    storage = storage or _local()
    folders = {storage.norm(p) for p in storage.list_dirs(run_dir, CHECKPOINT_PREFIX)}
    folders |= {storage.norm(p) for p in extra if storage.is_dir(p)}
    found = []
    for folder in folders:
        manifest, problem = read_manifest(folder, storage)
        found.append(Found(folder, int(manifest["step"]), int(manifest.get("created_ns", 0)), "")
                     if manifest else Found(folder, -1, 0, problem))
    return sorted(found, key=lambda f: (f.step, f.created_ns, f.path.name), reverse=True)


def choose(found: list[Found], log: Log, storage: Storage | None = None, workdir: str | Path | None = None
           ) -> Found | None:
    """The newest checkpoint whose files match its manifest (verified newest first; the bad ones are
    logged with the file that is bad and marked in ``found``). On a remote ``storage`` each candidate is first
    downloaded into ``workdir`` (a local folder) and verified there: the chosen one's ``local`` is that copy."""
    storage = storage or _local()
    for f in found:
        if f.problem:
            log(f"checkpoint {f.path.name} is not usable: {f.problem}")
            continue
        if storage.is_local:
            manifest, problem = verify(f.path)
        else:  # sizes first (a listing), then the bytes once: download, hash and load the same local copy
            manifest, problem = verify(f.path, hashes=False, storage=storage)
            if manifest is not None:
                local = storage.download_dir(f.path, Path(workdir or tempfile.mkdtemp(prefix="efftx-ckpt-")) / f.path.name)
                manifest, problem = verify(local)
                if manifest is not None:
                    f.local = local
                else:
                    shutil.rmtree(local, ignore_errors=True)
        if manifest is not None:
            return f
        f.problem = problem
        log(f"checkpoint {f.path.name} (step {f.step}) is not intact: {problem}; trying an older one")
    return None


def prune(found: list[Found], keep: int, tracked: set[Path], pinned: Path | None, log: Log,
          storage: Storage | None = None) -> list[Path]:
    """Delete the checkpoint folders that Ray does not track (``tracked``: Ray keeps and deletes those itself,
    and a tracked folder that vanished would break Ray's restore) and that are not among the newest ``keep``
    usable ones by step, nor ``pinned`` (the one being resumed from). Returns the removed folders."""
    storage = storage or _local()
    tracked = {storage.norm(p) for p in tracked}
    usable = [f for f in found if not f.problem]
    kept = {f.path for f in usable[:max(1, keep)]} | ({storage.norm(pinned)} if pinned else set())
    removed = []
    for f in found:
        if f.path in kept or f.path in tracked or not f.path.name.startswith(CHECKPOINT_PREFIX):
            continue
        why = f"step {f.step}, older than the newest {keep} kept" if not f.problem else f.problem
        storage.rmtree(f.path)
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

def _ray_tracked(storage: Storage) -> tuple[set[Path], Path | None]:
    """(folders of the checkpoints Ray Train has committed, the one ``get_checkpoint()`` offers)."""
    import ray.train

    current = ray.train.get_checkpoint()
    reported = ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
    tracked = {storage.norm(r.checkpoint.path) for r in reported}
    if current is not None:
        tracked.add(storage.norm(current.path))
    return tracked, (storage.norm(current.path) if current is not None else None)


def save(engine, state: dict[str, Any], metrics: dict[str, Any], rank: int, run_dir: str | Path,
         log: Log = lambda _: None, storage: Storage | None = None) -> Path:
    """Collective: every rank saves its DeepSpeed files into one Ray Train checkpoint; once every rank's
    upload has returned, rank 0 writes the manifest (the last file). Returns the checkpoint folder."""
    import ray.train

    storage = storage or _local()

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
    folder = storage.norm(f"{run_dir}/{name}")
    if rank == 0:
        if not storage.is_dir(folder):
            raise EfftxError(f"checkpoint folder {storage.uri(folder)} is not visible from rank 0: "
                             f"scaling.storage_path must be a folder every node shares, or a URI (s3://...)")
        write_manifest(folder, merge_digests(every_rank), step, len(every_rank), storage)
        log(f"checkpoint saved at step {step}: {storage.uri(folder)}")
    return folder


def restore(engine, rank: int, run_dir: str | Path, keep: int, log: Log = lambda _: None,
            storage: Storage | None = None) -> dict[str, Any] | None:
    """Collective: load the newest intact checkpoint of this run into ``engine``; return its loop state
    (None: nothing to resume). Rank 0 chooses among the run folder's checkpoints and Ray's by manifest
    step, verifies the files against the manifest before DeepSpeed unpickles any of them, removes orphaned
    folders (:func:`prune`) and tells the other ranks which one it chose. On a remote storage every rank loads
    from a local copy (rank 0's is the one it verified; the others download the chosen folder)."""
    storage = storage or _local()
    if storage.is_local:
        return _restore(engine, rank, run_dir, keep, log, storage, None)
    with tempfile.TemporaryDirectory(prefix="efftx-restore-") as workdir:
        return _restore(engine, rank, run_dir, keep, log, storage, Path(workdir))


def _restore(engine, rank: int, run_dir: str | Path, keep: int, log: Log, storage: Storage,
             workdir: Path | None) -> dict[str, Any] | None:
    chosen, local = None, None
    if rank == 0:
        tracked, current = _ray_tracked(storage)
        found = scan(run_dir, extra=[current] if current else [], storage=storage)
        best = choose(found, log, storage, workdir)
        if best is None and found:
            log(f"none of the {len(found)} checkpoint folders of this run is intact: starting from step 0")
        elif best is not None:
            ray_latest = next((f for f in found if current and f.path == current), None)
            ray_note = ("latest: none" if ray_latest is None else f"latest is step {ray_latest.step}"
                        if ray_latest.step >= 0 else f"latest, {ray_latest.path.name}, has no usable manifest")
            log(f"resuming from checkpoint {storage.uri(best.path)} (step {best.step}, files match its manifest; "
                f"Ray Train's {ray_note})")
        prune(found, keep, tracked, best.path if best else None, log, storage)
        chosen = str(best.path) if best else None
        local = best.local if best else None
    chosen = broadcast_json(chosen)
    if chosen is None:
        return None
    if not storage.is_local and local is None:  # the other ranks: a local copy of rank 0's choice
        local = storage.download_dir(chosen, workdir / PurePosixPath(chosen).name)
    folder = str(local) if local is not None else chosen
    state = json.loads(Path(folder, STATE_FILE).read_text())
    load_path, _ = engine.load_checkpoint(folder, tag=DS_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {storage.uri(chosen)}")
    from efftx.train.engine import replay_cpu_adam_steps

    replay_cpu_adam_steps(engine)
    return state


def prune_after_run(run_dir: str | Path, keep: int, log: Log = lambda _: None,
                    storage: Storage | None = None) -> list[Path]:
    """Rank 0, after the last report: wait until Ray has committed it, then remove the orphaned folders (a
    run resumed from a checkpoint Ray never committed leaves that folder behind otherwise). Folders are
    ranked by manifest step after a size check (no hashing: nothing is loaded here)."""
    storage = storage or _local()
    tracked, _ = _ray_tracked(storage)
    found = scan(run_dir, storage=storage)
    for f in found:
        if not f.problem:
            f.problem = verify(f.path, hashes=False, storage=storage)[1]
    return prune(found, keep, tracked, None, log, storage)


@contextmanager
def full_parameters(engine):
    """Make every parameter whole on every rank (ZeRO-3 partitions them); a no-op below stage 3."""
    if engine.zero_optimization_stage() != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        yield


def export_state(engine, keep: bool = True, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """The module's state for an export: every trained parameter at its fp32 master value where the optimizer
    keeps one (bf16/fp16 training: the module's own copy is rounded to 8 or 11 significant bits, the masters are
    what training reached), else the parameter itself; buffers as they are. Collective: every rank calls it,
    inside :func:`full_parameters` (each master is gathered from its ZeRO partitions, parameter by parameter, in
    the module's order). ``keep`` False (the ranks that do not write the export): each master is dropped once
    gathered, and nothing is returned. Kept masters go to host memory one by one: a ZeRO-3 model need not fit the
    device in fp32. Where DeepSpeed links no master to a trained half-precision parameter (its fp16 optimizer
    without ZeRO), that parameter goes as the engine holds it, and ``log`` says how many did."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters, unlinked = {}, 0
    for param in engine.module.parameters():  # the same order on every rank: the gathers pair up
        # frozen parameters (DALL-E's dVAE) have no master: the optimizer never sees them
        trained = param.requires_grad and param.dtype != torch.float32
        master = safe_get_full_fp32_param(param) if trained else None
        unlinked += trained and master is None
        if master is not None and keep:
            masters[id(param)] = master.detach().reshape(getattr(param, "ds_shape", param.shape)).cpu()
    if not keep:
        return {}
    if unlinked:
        log(f"export: {unlinked} trained half-precision parameters have no fp32 master that the optimizer links "
            "(DeepSpeed's fp16 optimizer without ZeRO): they are exported as the engine holds them")
    return {name: masters.get(id(value), value.detach())
            for name, value in engine.module.state_dict(keep_vars=True).items()}
