"""Train the Sinkhorn byte LM through the one efftx train loop.

    python jobs/train_sinkhorn.py [--recipe sinkhorn_small|sinkhorn_enwik8|sinkhorn_debug] [--set key=value ...] [--run-name NAME]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_sinkhorn.py

The default recipe (sinkhorn_small) trains on the bundled corpus; sinkhorn_enwik8 is the original script's
configuration (give the data: --set data.corpus=PATH/enwik8.gz).
"""

from efftx.cli import train_main

if __name__ == "__main__":
    raise SystemExit(train_main(default_recipe="sinkhorn_small", description=__doc__.splitlines()[0]))
