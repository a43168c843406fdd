"""efftx.weights: exports' model.safetensors written and read by the safetensors package, or, where it is not installed
(a GPU image with torch alone), by efftx's own code for the same format: files written either way read either way."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from efftx import weights

PACKAGE = weights._package()


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"w.{dtype}": (torch.randn(3, 5, generator=g) * 7).to(dtype)
           for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}
    out.update({"ints": torch.arange(-6, 6, dtype=torch.int64).reshape(2, 2, 3),
                "i32": torch.tensor([1, -2], dtype=torch.int32), "i16": torch.tensor([3], dtype=torch.int16), "i8": torch.tensor([-4], dtype=torch.int8),
                "u8": torch.tensor([250], dtype=torch.uint8), "mask": torch.tensor([True, False, True]),
                "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)})
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name


@pytest.mark.parametrize("writer, reader", [("own", "own"), ("own", "package"), ("package", "own")])
def test_files_written_either_way_read_either_way(tmp_path, monkeypatch, writer, reader):
    path, want = tmp_path / "model.safetensors", tensors()
    monkeypatch.setattr(weights, "_package", lambda: PACKAGE if writer == "package" else None)
    weights.save(want, path, metadata={"format": "pt", "efftx.recipe": "lm_debug"})
    monkeypatch.setattr(weights, "_package", lambda: PACKAGE if reader == "package" else None)
    assert_same(weights.load(path), want)
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert json.loads(path.read_bytes()[8:8 + size])["__metadata__"]["efftx.recipe"] == "lm_debug"


def test_an_export_loads_with_torch_alone(tmp_path, monkeypatch):
    """export + load_export without the safetensors package: the same model, and a file the package then reads."""
    from efftx import recipes
    from efftx.export import export, load_export
    from efftx.models import build

    cfg = recipes.get("spec_target_debug").override({"name": "w"})
    torch.manual_seed(0)
    model = build(cfg).eval()
    monkeypatch.setattr(weights, "_package", lambda: None)
    export(model, cfg, tmp_path / "export", {"step": 1})
    loaded, _, meta = load_export(tmp_path / "export")
    assert meta == {"step": 1}
    want = {k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert_same(loaded.state_dict(), want)
    monkeypatch.setattr(weights, "_package", lambda: PACKAGE)
    assert_same(weights.load(tmp_path / "export" / "model.safetensors"), loaded.state_dict())


@pytest.mark.parametrize("cut", ["short", "header", "json", "offsets", "dtype"])
def test_a_file_that_is_not_one_is_a_clear_error(tmp_path, monkeypatch, cut):
    monkeypatch.setattr(weights, "_package", lambda: None)
    path = tmp_path / "model.safetensors"
    weights.save({"a": torch.ones(4), "b": torch.zeros(2, 2)}, path)
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    if cut == "short":
        raw = raw[:5]
    elif cut == "header":
        raw = struct.pack("<Q", len(raw)) + raw[8:]
    elif cut == "json":
        raw = raw[:8] + b"}" + raw[9:]
    else:
        if cut == "offsets":
            header["b"]["data_offsets"] = [0, 999]
        else:
            header["b"]["dtype"] = "F8_E9M9"
        text = json.dumps(header).encode()
        raw = struct.pack("<Q", len(text)) + text + raw[8 + size:]
    path.write_bytes(raw)
    with pytest.raises(weights.WeightsError):
        weights.load(path)
    if PACKAGE is not None and cut != "dtype":  # the package refuses the same files (as a WeightsError)
        monkeypatch.setattr(weights, "_package", lambda: PACKAGE)
        with pytest.raises(weights.WeightsError):
            weights.load(path)


@pytest.mark.parametrize("own", [False, True], ids=["package", "own"])
def test_an_export_with_a_torn_weight_file_is_a_clear_error(tmp_path, monkeypatch, own):
    from efftx import recipes
    from efftx.errors import ExportError
    from efftx.export import export, load_export
    from efftx.models import build

    cfg = recipes.get("spec_draft_debug").override({"name": "w"})
    export(build(cfg), cfg, tmp_path, {})
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])  # torn: a copy cut short
    if own:
        monkeypatch.setattr(weights, "_package", lambda: None)
    with pytest.raises(ExportError, match="cannot read .*model.safetensors"):
        load_export(tmp_path)
