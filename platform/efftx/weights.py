"""Exports' weight files (``model.safetensors``) written and read with the ``safetensors`` package where it is
installed, else by this module's own reader and writer of the same format, so that an export loads on a machine with
torch alone (a bare GPU image: ``bench/gpu_check.py``'s serving and speculative sections).

The format (safetensors' documented layout): an unsigned little-endian 64-bit header length N, N bytes of a JSON
header (per tensor: ``dtype``, ``shape``, ``data_offsets`` [begin, end) into the data that follows; an optional
``__metadata__`` of strings), then the tensors' bytes, row-major, little-endian. Files written either way read either
way (tested).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # a header past this is not one (the package refuses such files too)


class WeightsError(ValueError):
    """A weight file that is not a valid safetensors file (torn, truncated, or something else)."""


def _package():
    """``safetensors.torch`` where it is installed (None: the built-in reader and writer)."""
    try:
        import safetensors.torch as package
    except ImportError:
        return None
    return package


def save(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (on the host, contiguous, not sharing memory) to ``path``."""
    package = _package()
    if package is not None:
        package.save_file(tensors, str(path), metadata=metadata)
        return
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset, blobs = 0, []
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in NAMES:
            raise WeightsError(f"{name}: dtype {t.dtype} cannot be written to safetensors")
        data = _bytes(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the package writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)


def load(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of the file at ``path``, on ``device``. Raises :class:`WeightsError` (a file that is not one) or
    ``OSError`` (a file that cannot be read)."""
    package = _package()
    if package is not None:
        from safetensors import SafetensorError

        try:
            return package.load_file(str(path), device=str(device))
        except SafetensorError as exc:
            raise WeightsError(str(exc)) from None
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise WeightsError(f"{len(data)} bytes: too short for a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > MAX_HEADER or 8 + size > len(data):
        raise WeightsError(f"a header of {size} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[8:8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"its header is not JSON: {exc}") from None
    body = memoryview(data)[8 + size:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{name}: a header entry safetensors does not write: {entry!r}") from None
        count = 1
        for n in shape:
            count *= n
        if not 0 <= begin <= end <= len(body) or end - begin != count * _itemsize(dtype):
            raise WeightsError(f"{name}: bytes [{begin}, {end}) do not hold a {dtype} tensor of shape {shape} "
                               f"(the data is {len(body)} bytes)")
        flat = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype) if count else torch.empty(0, dtype=dtype)
        if sys.byteorder != "little" and _itemsize(dtype) > 1:
            flat = flat.view(torch.uint8).view(-1, _itemsize(dtype)).flip(1).contiguous().view(dtype).view(-1)
        out[name] = flat.reshape(shape).to(device)
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _bytes(t: torch.Tensor) -> bytes:
    """``t``'s bytes, little-endian, row-major."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:
        raw = raw.view(-1, t.element_size()).flip(1).reshape(-1)
    return bytes(raw.clone().untyped_storage()) if raw.numel() else b""  # a storage of its own, exactly its bytes
