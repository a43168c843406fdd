"""Sweep config keys with Ray Tune over the efftx train loop.

    python tune/sweep.py --space sinkhorn_blocks | --space-file SPACE.yaml
                         [--search grid|random|optuna] [--scheduler asha|none] [--samples N]
                         [--recipe R] [--max-concurrent K] [--set key=value ...] [--name NAME]

Prints a results table and the best config; the last line is a JSON summary. The plot (metric against
the swept keys) and the table are logged to the sweep's MLflow parent run. Re-running a command with the
--name of an interrupted sweep resumes it: finished trials are kept, not run again.
"""

from efftx.tuning import sweep_main

if __name__ == "__main__":
    raise SystemExit(sweep_main())
