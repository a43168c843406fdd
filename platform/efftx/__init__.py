"""efftx: train, tune and serve efficient-attention transformers on Ray."""

__version__ = "0.1.0"
