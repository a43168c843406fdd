"""Training: the one per-worker loop (loop.py), Tasks, the DeepSpeed engine, checkpoints, launch."""
