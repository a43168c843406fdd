"""The playground: a web page served by the text app at ``/playground`` (``/`` redirects there).

The page is three static files in ``efftx/serving/static/`` (HTML, CSS, plain JavaScript; no build step,
nothing fetched from another address). Everything it shows comes from the app's own endpoints:

* ``GET /models/info`` (:class:`~efftx.serving.schemas.ModelsInfo`): the loaded models and the limits;
  the image tab is shown only when an image model is loaded;
* ``POST /generate/stream`` (:mod:`efftx.serving.streaming`), one stream per mode, base and speculative
  side by side;
* ``POST /images/generate`` with ``response_format: "b64_json"`` for the image grid.

The page addresses these with relative URLs, so it also works when the app has a ``route_prefix``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, RedirectResponse
from torch import nn

from efftx.serving.schemas import ModelCard

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {"playground.css": "text/css", "playground.js": "text/javascript"}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def root(request: Request) -> RedirectResponse:
    return RedirectResponse(str(request.url_for("playground_page")))


@router.get("/playground")
async def playground_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "playground.html", media_type="text/html")


@router.get("/playground/static/{name}")
async def playground_static(name: str) -> FileResponse:
    if name not in STATIC_FILES:  # only the page's own files, never a path into the filesystem
        raise HTTPException(status_code=404, detail=f"no static file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])


@lru_cache(maxsize=None)  # resolved once per process: at load time for the text models
def mlflow_version(source: str) -> tuple[str | None, str | None]:
    """(registered model name, version) of a ``models:/...`` source, "latest" resolved to the newest version
    (what the server loaded); (None, None) for an export folder; the version as written if the registry
    cannot say."""
    if not source.startswith("models:/"):
        return None, None
    from efftx.errors import ExportError
    from efftx.export import registered_version

    try:
        return registered_version(source)
    except ExportError:  # the card then shows the source as written; serving does not depend on it
        name, _, version = source[len("models:/"):].partition("/")
        return name, version or None


def linear_weights(model) -> str:
    """The dtype the model's Linear weights are held in (``float32``; ``bfloat16`` with ``decode_weights``)."""
    dtypes = {str(m.weight.dtype).removeprefix("torch.") for m in model.modules() if isinstance(m, nn.Linear)}
    return ",".join(sorted(dtypes)) or "none"


def model_card(role: str, model, cfg, source: str, model_id: str, device: str | None = None) -> ModelCard:
    """The card of a loaded LM; ``cfg``: the run config of its export; ``device``: where it decodes (default: where
    ``model`` is)."""
    name, version = mlflow_version(source)
    return ModelCard(role=role, id=model_id, source=source, mlflow_model=name, mlflow_version=version,
                     recipe=cfg.recipe, parameters=sum(p.numel() for p in model.parameters()),
                     device=device or str(next(model.parameters()).device),
                     details={"attention": cfg.attention.kind, "depth": cfg.model.depth, "dim": cfg.model.dim,
                              "context": cfg.model.max_seq_len, "vocab_size": cfg.model.vocab_size,
                              "linear_weights": linear_weights(model)})


def image_card(info: dict) -> ModelCard:
    """The card of the image model from ``ImageGenerator.info()``."""
    name, version = mlflow_version(info["source"])
    return ModelCard(role="image", id=info["id"], source=info["source"], mlflow_model=name, mlflow_version=version,
                     recipe=info["recipe"], parameters=info["parameters"], device=info.get("device", "cpu"),
                     details={k: info[k] for k in ("image_size", "text_seq_len") if k in info})
