"""Where efftx writes things by default.

Everything a run produces (Ray Train storage with checkpoints and exports, the MLflow sqlite
database and artifacts, cached corpora) lives under one *home* directory:

1. ``$EFFTX_HOME`` if set;
2. else ``<repo>/.efftx`` when efftx is installed editable from a checkout (the usual case; this
   also holds for ``ray job submit``, whose workers import efftx from the cluster's venv);
3. else ``~/.efftx``.
"""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path | None:
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "platform" / "efftx").is_dir() else None


def home() -> Path:
    env = os.environ.get("EFFTX_HOME")
    if env:
        path = Path(env).expanduser()
    else:
        root = repo_root()
        path = root / ".efftx" if root else Path.home() / ".efftx"
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def default_storage_path() -> str:
    return str(home() / "runs")


def default_data_dir() -> str:
    return str(home() / "data")
