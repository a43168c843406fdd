"""The text-to-image library API: an exported DALL-E (its frozen dVAE inside) that draws captions.

    gen = DalleGenerator.load("runs/x/export")            # or "models:/dalle_shapes_debug/1"
    images = gen.generate(["a red circle on a blue background"], num_images=2, seed=0)   # (2, C, S, S) in [0, 1]
    png = png_bytes(images[0])                             # efftx.generation.png

The captions are tokenized as in training: the export's ``tokenizer.json`` when it has one (trained with
``data.image.bpe_path``), else bytes. Prompts longer than ``dalle.text_seq_len`` tokens are cut (and reported).
``python -m efftx.generate_images`` (the command line) and the image endpoint (efftx.serving.images) use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from efftx.errors import ExportError


def check_sampling(*, num_images: int = 1, filter_thres: float = 0.9, top_p: float = 1.0, temperature: float = 1.0,
                   cond_scale: float = 1.0, batch_size: int | None = None) -> None:
    """Sampling arguments, checked before any model is loaded; ExportError naming the argument."""
    problems = []
    if num_images < 1:
        problems.append(f"num_images must be >= 1, got {num_images}")
    if batch_size is not None and batch_size < 1:
        problems.append(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= filter_thres <= 1:
        problems.append(f"filter_thres must be in [0, 1], got {filter_thres}")
    if not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {top_p}")
    if not temperature >= 0:
        problems.append(f"temperature must be >= 0, got {temperature}")
    if not (math.isfinite(cond_scale) and cond_scale >= 0):
        problems.append(f"cond_scale must be a finite number >= 0, got {cond_scale}")
    if problems:
        raise ExportError("; ".join(problems))


@dataclass
class DalleGenerator:
    """An exported DALL-E ready to draw: the model (eval mode), its run config and caption tokenizer."""

    model: torch.nn.Module
    cfg: Any  # efftx.config.Config of the export
    tokenizer: Any  # efftx.data.text_tokens.Tokenizer
    source: str

    @classmethod
    def load(cls, source: str, device: str | torch.device = "cpu", tracking_uri: str = "") -> "DalleGenerator":
        """From an export folder or an MLflow registered model (models:/NAME/VERSION or models:/NAME@ALIAS)."""
        from efftx.data.text_tokens import HFTokenizer, load_tokenizer
        from efftx.export import TOKENIZER_FILE, load_export, resolve_export
        from efftx.models.dalle import DALLE

        path = resolve_export(source, tracking_uri)
        model, cfg, _ = load_export(path, device)
        if not isinstance(model, DALLE):
            raise ExportError(f"{source} is a {cfg.model.family!r} export, not a DALL-E (model.family=dalle)")
        token_file = path / TOKENIZER_FILE
        if token_file.is_file():
            tokenizer = HFTokenizer(token_file.read_text(encoding="utf-8"), source=str(token_file))
        else:
            tokenizer = load_tokenizer(cfg.data.image.bpe_path)  # bytes, or the training machine's JSON
        if tokenizer.vocab_size != cfg.model.vocab_size:
            raise ExportError(f"the tokenizer of {source} has {tokenizer.vocab_size} ids, the model "
                              f"model.vocab_size={cfg.model.vocab_size}")
        return cls(model, cfg, tokenizer, source)

    @property
    def image_size(self) -> int:
        return self.cfg.vae.image_size

    @property
    def channels(self) -> int:
        return self.cfg.vae.channels

    @property
    def text_seq_len(self) -> int:
        return self.cfg.dalle.text_seq_len

    def encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, list[bool]]:
        """Prompts -> ((P, text_seq_len) caption ids, which prompts were cut to fit). Empty prompts are an error."""
        from efftx.data.text_tokens import tokenize_batch

        if not prompts or any(not p.strip() for p in prompts):
            raise ExportError("every prompt must hold some text")
        cut = [len(self.tokenizer.encode(p)) > self.text_seq_len for p in prompts]
        return tokenize_batch(self.tokenizer, list(prompts), self.text_seq_len, truncate=True), cut

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], *, num_images: int = 1, filter_thres: float = 0.9, top_p: float = 1.0,
                 temperature: float = 1.0, cond_scale: float = 1.0, seed: int | None = None,
                 batch_size: int | None = None, use_cache: bool = True) -> torch.Tensor:
        """``num_images`` images per prompt: (P * num_images, C, S, S) float in [0, 1], row ``p * num_images + i``
        = image i of prompt p, drawn with its own seed ``seed + i`` (as the image server does), so an image does
        not depend on ``batch_size`` (images drawn at once; default: a prompt's images at once)."""
        from efftx.generation.images import generate_images

        check_sampling(num_images=num_images, filter_thres=filter_thres, top_p=top_p, temperature=temperature,
                       cond_scale=cond_scale, batch_size=batch_size)
        text, _ = self.encode(prompts)
        sampling = {"filter_thres": filter_thres, "top_p": top_p, "temperature": temperature,
                    "cond_scale": cond_scale, "use_cache": use_cache}
        chunk = batch_size or num_images
        out = []
        for p in range(len(prompts)):
            for start in range(0, num_images, chunk):
                n = min(chunk, num_images - start)
                seeds = [None if seed is None else seed + start + i for i in range(n)]
                images, _ = generate_images(self.model, text[p:p + 1], num_images=n, seed=seeds, **sampling)
                out.append(images.float().cpu())
        return torch.cat(out)
