"""efftx: train, tune and serve efficient-attention transformers on Ray.

"The seed" in a module's comments is the original research script of that module's model family (Sinkhorn
and Performer on enwik8, Native Sparse Attention, speculative decoding, DALL-E and its dVAE), which efftx
replaces: its settings and figures carry over into the recipes, its code does not (docs/architecture.md).
"""

__version__ = "0.1.0"

import os as _os

# No phone-home: MLflow 3 sends usage telemetry to its servers from every client unless told not to, and efftx
# runs offline (a user who wants it sets MLFLOW_DISABLE_TELEMETRY=false). Set before efftx imports MLflow.
_os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
