"""Which device a Serve replica decodes on, the CPU and GPU shares it asks Ray for, and its torch threads.

The app builder (:func:`efftx.serving.text.build`) takes

* ``num_gpus`` / ``image_num_gpus``: the GPU share of each text / image replica (``ray_actor_options.num_gpus``;
  fractions such as 0.5 let two replicas share one GPU). 0 (the default) asks for none.
* ``device``: ``auto`` (the default), ``cpu`` or ``cuda``. ``auto`` is CUDA when the replica was given a GPU
  share (Ray then lists a GPU id for it) and torch sees a CUDA device, else the CPU; so on CPU-only machines
  nothing changes. ``cuda`` is checked when the app is built: with no CUDA device in sight (torch sees none here
  and the connected Ray cluster has no ``GPU`` resource) it is an error naming the argument, not a crash inside
  a replica; ``cuda`` without a ``num_gpus`` gives each deployment half a GPU (text and image replicas share one).

On a CPU, ``threads`` (default 1) is torch's intra-op thread count in every thread a text replica decodes in (the
continuous-batching thread, the static batches' worker threads, the steps of a stream): a larger batch's products
spread over that many cores. ``num_cpus`` reserves the replica's CPU share with Ray (``ray_actor_options.num_cpus``;
the deployment's default is 0.25): give as many CPUs as threads on a shared cluster.

The models are loaded onto the replica's device (``load_export(path, device)``) and every tensor of a request is
made there; ``GET /models/info`` names each model's device (``"cpu"``, ``"cuda:0"``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TypeVar

import torch

T = TypeVar("T")

DEVICES = ("auto", "cpu", "cuda")
CUDA_DEFAULT_SHARE = 0.5  # num_gpus of each deployment when device=cuda and no share is given


def gpu_share(value, name: str) -> float | None:
    """A ``num_gpus``-like builder argument as a float >= 0 (None when not given)."""
    if value is None or value == "":
        return None
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of GPUs per replica (for example 1 or 0.5), got {value!r}") from None
    if not share >= 0 or share != share or share == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return share


def cuda_in_sight() -> bool:
    """Whether a CUDA device can serve: torch sees one here, or the connected Ray cluster offers GPUs."""
    if torch.cuda.is_available():
        return True
    try:
        import ray

        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    except Exception:  # noqa: BLE001 - no cluster to ask: only this machine counts
        return False


def resolve_build_devices(device: str | None, num_gpus, image_num_gpus) -> tuple[str, float | None, float | None]:
    """Check the builder's ``device`` / ``num_gpus`` / ``image_num_gpus``; return them with the defaults applied
    (None: leave the deployment's own ``ray_actor_options`` alone)."""
    device = str(device or "auto").strip().lower()
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    text_share, image_share = gpu_share(num_gpus, "num_gpus"), gpu_share(image_num_gpus, "image_num_gpus")
    if device == "cuda":
        if not cuda_in_sight():
            raise ValueError("device=cuda, but there is no CUDA device: torch sees none on this machine and the Ray "
                             "cluster offers no GPU resources (use device=auto or device=cpu)")
        for name, share in (("num_gpus", text_share), ("image_num_gpus", image_share)):
            if share == 0:
                raise ValueError(f"device=cuda with {name}=0: a replica without a GPU share cannot decode on CUDA")
        text_share = CUDA_DEFAULT_SHARE if text_share is None else text_share
        image_share = CUDA_DEFAULT_SHARE if image_share is None else image_share
    return device, text_share, image_share


def replica_device(requested: str = "auto") -> torch.device:
    """The device this process (a Serve replica) decodes on; see the module docstring."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda, but torch sees no CUDA device in this replica (was it given num_gpus?)")
        return torch.device("cuda", torch.cuda.current_device())
    if requested != "auto":
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {requested!r}")
    if _given_a_gpu() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cache_budget(cache_mib: float | None, cache_fraction: float | None, device: torch.device,
                 gpu_share: float | None = None) -> int | None:
    """The bytes a replica's decoding caches may hold (``cache_mib``, or ``cache_fraction`` of ``device``'s memory:
    on a GPU, of the replica's share of it, ``gpu_share`` of its total memory (up to all of it; None or 0: all of
    it), so that replicas sharing a GPU each take their fraction of their own part; on a CPU, of the machine's
    physical memory); None when neither is given."""
    if cache_mib is not None and cache_fraction is not None:
        raise ValueError("cache_mib and cache_fraction: give one of them")
    if cache_mib is not None:
        if not cache_mib > 0:
            raise ValueError(f"cache_mib must be > 0, got {cache_mib!r}")
        return max(int(cache_mib * 2**20), 1)
    if cache_fraction is None:
        return None
    if not 0 < cache_fraction <= 1:
        raise ValueError(f"cache_fraction must be in (0, 1], got {cache_fraction!r}")
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if gpu_share is not None and gpu_share < 0:
            raise ValueError(f"gpu_share must be >= 0, got {gpu_share!r}")
        if gpu_share:
            total = min(gpu_share, 1.0) * total
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(int(cache_fraction * total), 1)


def replica_gpu_share() -> float | None:
    """The GPU share Ray reserved for this process (a replica's ``num_gpus``, e.g. 0.5), or None: outside Ray, or
    given none."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        share = ray.get_runtime_context().get_assigned_resources().get("GPU")
    except Exception:  # noqa: BLE001 - no runtime context to ask: no share known
        return None
    return float(share) if share else None


def _given_a_gpu() -> bool:
    try:
        import ray

        return ray.is_initialized() and bool(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - outside Ray: no GPU was given
        return False


def with_resources(deployment, *, num_gpus: float | None = None, num_cpus: float | None = None):
    """``deployment`` with the shares given (not None) set in its ``ray_actor_options`` (unchanged for none)."""
    given = {k: v for k, v in (("num_gpus", num_gpus), ("num_cpus", num_cpus)) if v is not None}
    if not given:
        return deployment
    return deployment.options(ray_actor_options={**(deployment.ray_actor_options or {}), **given})


def with_threads(steps: Iterator[T], threads: int) -> Iterator[T]:
    """``steps`` with torch's intra-op threads set to ``threads`` before each step is computed: a sync stream's
    steps run in whichever thread of Starlette's pool takes them, and a new thread starts with the process
    default (``OMP_NUM_THREADS``, which Ray sets from the replica's CPU share), not the replica's setting."""
    it = iter(steps)
    while True:
        torch.set_num_threads(threads)
        try:
            item = next(it)
        except StopIteration:
            return
        yield item
