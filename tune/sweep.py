"""Sweep config keys with Ray Tune over the efftx train loop.

    python tune/sweep.py --space sinkhorn_blocks [--recipe R] [--samples N] [--max-concurrent K] [--set key=value ...]

Prints a results table and the best config; the last line is a JSON summary. The plot (metric against
the swept keys) and the table are logged to the sweep's MLflow parent run.
"""

from efftx.tuning import sweep_main

if __name__ == "__main__":
    raise SystemExit(sweep_main())
