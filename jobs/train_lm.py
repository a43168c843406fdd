"""Train a byte-level LM through the one efftx train loop.

    python jobs/train_lm.py --recipe lm_debug [--set key=value ...] [--run-name NAME] [--workers N]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_lm.py --recipe lm_debug
"""

from efftx.cli import train_main

if __name__ == "__main__":
    raise SystemExit(train_main(default_recipe="lm_small"))
