"""Train DALL-E through the one efftx train loop, on a given dVAE or on one trained first.

    python jobs/train_dalle.py [--recipe dalle_shapes_small|dalle|dalle_shapes_debug] [--vae PATH|models:/NAME/VERSION]
                               [--set key=value ...] [--vae-set key=value ...] [--run-name NAME] [--workers N]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_dalle.py --recipe dalle_shapes_debug

Without --vae, the recipe's paired dVAE (dalle_X -> dvae_X, or --vae-recipe) is trained first as run
<name>-dvae, then DALL-E as <name>-dalle on its export; re-using --run-name resumes them. The dVAE is frozen
inside DALL-E and the DALL-E export holds both (python -m efftx.generate_images --model EXPORT --prompt ...).
The last line printed is {"dvae": summary or null, "dalle": summary}.
"""

from efftx.cli import train_dalle_main

if __name__ == "__main__":
    raise SystemExit(train_dalle_main())
