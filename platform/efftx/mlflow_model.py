"""Exports as MLflow models: the efftx ``pyfunc`` flavour, so that any registered version loads with
``mlflow.pyfunc.load_model("models:/NAME@champion")`` and its ``predict`` generates.

A logged model (an MLflow 3 LoggedModel, registered as a model version) is laid out as::

    MLmodel                       flavour python_function, loader mlflow.pyfunc.loaders.code_model
    efftx_pyfunc.py               3 lines of code (models from code): builds :class:`EfftxModel`, nothing pickled
    requirements.txt, python_env.yaml, conda.yaml    written from pinned versions, never resolved at load time
    input_example.json, serving_input_example.json
    artifacts/model.safetensors   \\
    artifacts/config.json          > the efftx export itself (weights, run config, any task file such as
    artifacts/tokenizer.json      /  tokenizer.json): efftx.export.resolve_export hands this folder out

What ``predict`` takes and returns depends on the model the export builds (checked with ``isinstance``, as
:class:`efftx.generation.text_to_image.DalleGenerator` does; the family is never compared with a string here):

* a language model: rows ``{prompt, max_new_tokens?, temperature?, top_k?, top_p?, seed?}`` (a DataFrame or a
  list of dicts) -> a DataFrame with ``text``, the continuation; the same tokens as ``python -m efftx.generate``
  with the same seed (rows with the same sampling arguments are decoded as one batch, each with its own seed);
* a DALL-E: rows ``{prompt, seed?, temperature?, top_p?, filter_thres?, cond_scale?}`` -> ``image``, a base64
  PNG of ``vae.image_size`` pixels per row (image 0 of ``python -m efftx.generate_images`` with that seed);
* a dVAE: rows ``{image}`` (a base64 PNG, resized to ``vae.image_size``) -> ``image``, its reconstruction.

Loading needs efftx importable (the project's environment) and nothing else: no network, no environment
inference. ``model_config={"device": "cuda" | "auto" | "cpu"}`` at load picks the device (default cpu).
"""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import io
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

from efftx.errors import ExportError
from efftx.export import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, read_export_config

TEXT, IMAGE, RECONSTRUCTION = "text", "image", "reconstruction"
TEXT_DEFAULTS = {"max_new_tokens": 64, "temperature": 0.8, "top_k": 0, "top_p": 1.0, "seed": None}
IMAGE_DEFAULTS = {"seed": None, "temperature": 1.0, "top_p": 1.0, "filter_thres": 0.9, "cond_scale": 1.0}
MAX_BATCH = 16  # text rows decoded at once (model_config "max_batch_size")

# Models from code: MLflow copies this file into the model (efftx_pyfunc.py) and runs it at load.
MODEL_CODE = ('"""The efftx pyfunc model (models from code: the class is efftx.mlflow_model.EfftxModel)."""\n'
              "import mlflow.models\n\nfrom efftx.mlflow_model import EfftxModel\n\n"
              "mlflow.models.set_model(EfftxModel())\n")
REQUIREMENTS = ("efftx", "mlflow", "torch", "safetensors", "numpy", "pandas", "pillow")


def model_kind(cfg) -> str:
    """What the export's model does at predict time: TEXT, IMAGE or RECONSTRUCTION (built on the meta device:
    no memory, no weights)."""
    import torch

    from efftx import models
    from efftx.models.dalle import DALLE
    from efftx.models.dvae import DiscreteVAE
    from efftx.models.lm import LM

    try:
        with torch.device("meta"):
            model = models.build(cfg)
    except Exception:  # a model whose construction needs real tensors: build it for real (CPU)
        model = models.build(cfg)
    for cls, kind in ((DALLE, IMAGE), (DiscreteVAE, RECONSTRUCTION), (LM, TEXT)):
        if isinstance(model, cls):
            return kind
    raise ExportError(f"no MLflow pyfunc for a {type(model).__name__} export (model.family={cfg.model.family!r})")


def signature(kind: str):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema
    from mlflow.types.schema import AnyType

    # The optional numbers are typed "any": MLflow turns a column of integers with gaps (rows of a list of dicts that
    # leave a key out) into float64, which it refuses for a long column, and refuses int64 for a double column
    # (temperature=2); predict checks each value instead (a number; whole for max_new_tokens, top_k, seed).
    def optional(keys):
        return [ColSpec(AnyType(), k, required=False) for k in keys]

    if kind == TEXT:
        inputs = [ColSpec("string", "prompt"), *optional(TEXT_DEFAULTS)]
        outputs = [ColSpec("string", "text")]
    elif kind == IMAGE:
        inputs = [ColSpec("string", "prompt"), *optional(IMAGE_DEFAULTS)]
        outputs = [ColSpec("string", "image")]  # base64 PNG
    else:
        inputs, outputs = [ColSpec("string", "image")], [ColSpec("string", "image")]
    return ModelSignature(inputs=Schema(inputs), outputs=Schema(outputs))


def input_example(kind: str, cfg) -> list[dict[str, Any]]:
    if kind == TEXT:
        return [{"prompt": "The ", "max_new_tokens": max(1, min(16, cfg.model.max_seq_len - 4)), "temperature": 0.8,
                 "seed": 0}]
    if kind == IMAGE:
        return [{"prompt": "a red circle on a blue background", "seed": 0, "cond_scale": 1.0}]
    import torch

    from efftx.generation.png import png_bytes

    blank = torch.full((cfg.vae.channels, cfg.vae.image_size, cfg.vae.image_size), 0.5)
    return [{"image": base64.b64encode(png_bytes(blank)).decode()}]


def requirements(export_dir: str | Path) -> list[str]:
    """Pinned requirements of the installed packages (written to requirements.txt; MLflow infers nothing)."""
    names = REQUIREMENTS + (("tokenizers",) if (Path(export_dir) / TOKENIZER_FILE).is_file() else ())
    out = []
    for name in dict.fromkeys(names):
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


@contextlib.contextmanager
def _quiet():
    """No progress bars for the local copies of the artifacts and no info lines while saving (the signature check
    of the input example still raises)."""
    key, before = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    logger = logging.getLogger("mlflow.pyfunc")
    level = logger.level
    os.environ[key] = "false"
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def save(export_dir: str | Path, path: str | Path, mlflow_model=None) -> Path:
    """Write the MLflow model of the export folder ``export_dir`` to the new folder ``path``: its files become
    the model's artifacts (copied, not pickled), with the signature and an input example of its kind."""
    export_dir = Path(export_dir)
    cfg, _ = read_export_config(export_dir)
    kind = model_kind(cfg)
    artifacts = {"weights": str(export_dir / WEIGHTS_FILE), "config": str(export_dir / CONFIG_FILE)}
    for f in sorted(export_dir.iterdir()):  # the task's files (tokenizer.json); never temp files
        if f.is_file() and not f.name.startswith(".") and f.name not in (WEIGHTS_FILE, CONFIG_FILE):
            artifacts[f.name] = str(f)  # keyed by file name: never "weights" or "config"
    with tempfile.TemporaryDirectory(prefix="efftx-pyfunc-") as tmp, _quiet():
        code = Path(tmp, "efftx_pyfunc.py")
        code.write_text(MODEL_CODE)
        mlflow.pyfunc.save_model(str(path), python_model=str(code), artifacts=artifacts, signature=signature(kind),
                                 input_example=input_example(kind, cfg), pip_requirements=requirements(export_dir),
                                 mlflow_model=mlflow_model, metadata={"efftx.kind": kind, "efftx.recipe": cfg.recipe})
    return Path(path)


def log_export(client, run_id: str, export_dir: str | Path, name: str, step: int = 0):
    """Log the export folder as an MLflow model (a LoggedModel of ``run_id``'s experiment, output of the run at
    ``step``) through ``client`` alone (no global tracking URI, no active run); returns the LoggedModel."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    run = client.get_run(run_id)
    logged = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                        tags={"efftx.export": "1"})
    try:
        with tempfile.TemporaryDirectory(prefix="efftx-mlflow-model-") as tmp:
            model = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                          model_id=logged.model_id)
            local = save(export_dir, Path(tmp, "model"), mlflow_model=model)
            client.log_model_artifacts(logged.model_id, str(local))
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step)])
        return client.finalize_logged_model(logged.model_id, "READY")
    except BaseException:
        client.finalize_logged_model(logged.model_id, "FAILED")
        raise


# ------------------------------------------------------------------------------------------------ the model

def _records(model_input) -> list[dict[str, Any]]:
    """A DataFrame, a dict or a list of dicts -> rows; missing values (None, NaN) dropped from each row."""
    if isinstance(model_input, pd.DataFrame):
        rows = model_input.to_dict(orient="records")
    elif isinstance(model_input, dict):
        rows = [model_input]
    else:
        rows = list(model_input)
    if not all(isinstance(r, dict) for r in rows):
        raise ExportError("predict takes a DataFrame, a dict or a list of dicts (one per row)")

    def present(v):
        return v is not None and not (isinstance(v, float) and math.isnan(v)) and v is not pd.NA

    return [{k: v for k, v in r.items() if present(v)} for r in rows]


def _number(row: dict, key: str, i: int, whole: bool = False) -> float | int:
    """``row[key]`` as a float (``whole``: an int); ExportError naming the row and key otherwise."""
    value = row[key]
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise ExportError(f"row {i}: {key} must be a number, got {value!r}") from None
    if whole:
        if not number.is_integer():
            raise ExportError(f"row {i}: {key} must be a whole number, got {value!r}")
        return int(number)
    return number


def _b64_png(image) -> str:
    from efftx.generation.png import png_bytes

    return base64.b64encode(png_bytes(image)).decode("ascii")


class EfftxModel(mlflow.pyfunc.PythonModel):
    """The pyfunc of an efftx export: loads the export from the model's artifacts in :meth:`load_context`."""

    def load_context(self, context) -> None:
        import torch

        from efftx.export import load_export

        config = dict(context.model_config or {})
        device = str(config.get("device", "cpu"))
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.max_batch = int(config.get("max_batch_size", MAX_BATCH))
        self.export_dir = Path(context.artifacts["config"]).parent
        cfg, _ = read_export_config(self.export_dir)
        self.kind = model_kind(cfg)
        if self.kind == IMAGE:
            from efftx.generation.text_to_image import DalleGenerator

            self.generator = DalleGenerator.load(str(self.export_dir), self.device)
            self.model, self.cfg = self.generator.model, self.generator.cfg
        else:
            self.model, self.cfg, _ = load_export(self.export_dir, self.device)

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        import torch

        rows = _records(model_input)
        with torch.no_grad():
            if self.kind == TEXT:
                return pd.DataFrame({"text": self._text(rows)})
            if self.kind == IMAGE:
                return pd.DataFrame({"image": self._images(rows)})
            return pd.DataFrame({"image": self._reconstructions(rows)})

    def _text(self, rows: list[dict]) -> list[str]:
        """As :func:`efftx.generate.sample_text` per row (same checks, same tokens), rows that share their sampling
        arguments decoded together (row r with its own seed: the same tokens as alone)."""
        from efftx.data.lm_tokenizer import export_codec
        from efftx.generation.decode import generate

        codec = export_codec(self.export_dir, self.cfg)  # bytes, or the export's tokenizer.json
        groups: dict[tuple, list[tuple[int, list[int], int | None]]] = {}
        for i, row in enumerate(rows):
            prompt = row.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise ExportError(f"row {i}: the prompt is empty")
            tokens = codec.encode(prompt)
            a = {**TEXT_DEFAULTS, **row}
            room = self.model.max_seq_len - len(tokens)
            max_new = _number(row, "max_new_tokens", i, whole=True) if "max_new_tokens" in row else min(
                a["max_new_tokens"], room)
            temperature, top_p = _number(a, "temperature", i), _number(a, "top_p", i)
            top_k = _number(a, "top_k", i, whole=True)
            if max_new < 1:
                raise ExportError(f"row {i}: max_new_tokens must be >= 1, got {max_new}")
            if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
                raise ExportError(f"row {i}: temperature must be >= 0, top_k >= 0 and top_p in (0, 1]")
            if max_new > room:
                raise ExportError(f"row {i}: prompt ({len(tokens)} {codec.unit}) + max_new_tokens ({max_new}) exceeds "
                                  f"the model's max_seq_len={self.model.max_seq_len}")
            seed = None if a["seed"] is None else _number(a, "seed", i, whole=True)
            groups.setdefault((max_new, temperature, top_k, top_p), []).append((i, tokens, seed))
        out: list[str] = [""] * len(rows)
        for (max_new, temperature, top_k, top_p), items in groups.items():
            for start in range(0, len(items), self.max_batch):
                chunk = items[start:start + self.max_batch]
                new = generate(self.model, [t for _, t, _ in chunk], max_new, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=[s for _, _, s in chunk])
                for (i, prompt_ids, _), tokens in zip(chunk, new.tolist()):
                    out[i] = codec.continuation(prompt_ids, tokens)
        return out

    def _images(self, rows: list[dict]) -> list[str]:
        out = []
        for i, row in enumerate(rows):
            prompt = row.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise ExportError(f"row {i}: the prompt is empty")
            a = {**IMAGE_DEFAULTS, **row}
            sampling = {k: _number(a, k, i) for k in IMAGE_DEFAULTS if k != "seed"}
            seed = None if a["seed"] is None else _number(a, "seed", i, whole=True)
            images = self.generator.generate([prompt], num_images=1, seed=seed, **sampling)
            out.append(_b64_png(images[0]))
        return out

    def _reconstructions(self, rows: list[dict]) -> list[str]:
        import numpy as np
        import torch
        from PIL import Image

        size, channels = self.cfg.vae.image_size, self.cfg.vae.channels
        mode = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
        batch = []
        for i, row in enumerate(rows):
            try:
                img = Image.open(io.BytesIO(base64.b64decode(row["image"], validate=True))).convert(mode)
            except (KeyError, ValueError, OSError) as exc:
                raise ExportError(f"row {i}: 'image' must be a base64 PNG or JPEG ({exc})") from None
            arr = np.asarray(img.resize((size, size)) if img.size != (size, size) else img, dtype=np.float32) / 255
            batch.append(torch.from_numpy(arr.reshape(size, size, channels)).permute(2, 0, 1))
        if not batch:
            return []
        recon = self.model.reconstruct(torch.stack(batch).to(self.device))
        return [_b64_png(r.float().cpu()) for r in recon]
