"""Models built from the shared layers, one family per module, each registered with
:mod:`efftx.models.registry`: the byte/token decoder ``lm``, the discrete VAE ``dvae``, and ``dalle``.

``efftx.models.build(cfg)`` builds the model of ``cfg.model.family`` from the config's model-only sections.
"""

from efftx.models import dalle, dvae, lm  # noqa: F401  (importing a model module registers its family)
from efftx.models.registry import build, families, register

__all__ = ["build", "families", "register"]
