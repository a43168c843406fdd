"""Train the Performer byte LM through the one efftx train loop.

    python jobs/train_performer.py [--recipe performer_small|performer_enwik8|performer_debug] [--set key=value ...] [--run-name NAME]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_performer.py

The default recipe (performer_small) trains on the bundled corpus; performer_enwik8 is the original script's
configuration (give the data: --set data.corpus=PATH/enwik8.gz).
"""

from efftx.cli import train_main

if __name__ == "__main__":
    raise SystemExit(train_main(default_recipe="performer_small", description=__doc__.splitlines()[0]))
