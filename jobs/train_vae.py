"""Train the discrete VAE (DALL-E's image tokenizer) through the one efftx train loop.

    python jobs/train_vae.py [--recipe dvae_shapes_small|dvae|dvae_shapes_debug] [--set key=value ...] [--run-name NAME]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_vae.py --recipe dvae_shapes_debug

The data is data.image.source (default: synthetic captioned shapes, made offline); vae.* configures the model.
MLflow gets reconstructions (originals beside reconstructions, PNG) and codebook usage; the export is
registered under the recipe name and is what jobs/train_dalle.py --vae takes.
"""

from efftx.cli import train_main

if __name__ == "__main__":
    raise SystemExit(train_main(default_recipe="dvae_shapes_small", description=__doc__.splitlines()[0]))
