"""Train a speculative-decoding pair through the one efftx train loop: the draft, then the target.

    python jobs/train_speculative.py [--size debug|small|enwik8] [--set key=value ...] [--run-name NAME]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_speculative.py --size debug

While the target trains, every sample decodes the same prompt with the target alone and with
speculative decoding against the draft, and logs both times and the mean accepted draft tokens to MLflow.
Both models are exported and registered (spec_draft_<size>, spec_target_<size>).

    python jobs/train_speculative.py --size small --distill [--target EXPORT] [--draft-set distill.alpha=0.5]

trains the target first (or takes EXPORT), then a draft distilled from it (distill.teacher: KL to the
target's distribution on the same batches), and measures the target against that draft once at the end.
"""

from efftx.cli import train_speculative_main

if __name__ == "__main__":
    raise SystemExit(train_speculative_main())
