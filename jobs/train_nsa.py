"""Train the Native Sparse Attention byte LM through the one efftx train loop.

    python jobs/train_nsa.py [--recipe nsa_small|nsa_enwik8|nsa_debug|nsa_full_small|nsa_full_enwik8|nsa_full_debug] [--set key=value ...] [--run-name NAME]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_nsa.py

The default recipe (nsa_small) trains on the bundled corpus; nsa_enwik8 is the original script's configuration
(give the data: --set data.corpus=PATH/enwik8.gz) and nsa_full_enwik8 the same model with full attention.
"""

from efftx.cli import train_main

if __name__ == "__main__":
    raise SystemExit(train_main(default_recipe="nsa_small", description=__doc__.splitlines()[0]))
