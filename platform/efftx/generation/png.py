"""Images as files: tensors -> Pillow images -> PNG bytes, and captioned grids of images.

Used by the image tasks' samples (logged to MLflow as PNG), by ``python -m efftx.generate_images`` and
by anything serving images. Images are ``(C, H, W)`` float tensors in ``[0, 1]`` with 1 (L), 3 (RGB)
or 4 (RGBA) channels, as the dVAE and the image data produce them.
"""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

_PAD = 4  # pixels between grid cells and around captions


def to_pil(image: torch.Tensor) -> Image.Image:
    """(C, H, W) float in [0, 1] (C = 1, 3 or 4) -> a Pillow image (L, RGB or RGBA)."""
    if image.ndim != 3 or image.shape[0] not in (1, 3, 4):
        raise ValueError(f"an image is a (channels, height, width) tensor with 1, 3 or 4 channels; got {tuple(image.shape)}")
    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else np.ascontiguousarray(arr))


def png_bytes(image: Image.Image | torch.Tensor) -> bytes:
    """A Pillow image or a (C, H, W) tensor in [0, 1] as PNG file bytes."""
    if isinstance(image, torch.Tensor):
        image = to_pil(image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _rgb(img: Image.Image) -> Image.Image:
    """RGB on white (transparent pixels of RGBA images show the white)."""
    if img.mode == "RGBA":
        back = Image.new("RGB", img.size, "white")
        back.paste(img, mask=img.getchannel("A"))
        return back
    return img.convert("RGB")


def _wrap(draw: ImageDraw.ImageDraw, text: str, font, width: int) -> list[str]:
    """Greedy word wrap of ``text`` into lines at most ``width`` pixels wide (long words are cut)."""
    lines: list[str] = []
    for word in text.split():
        while draw.textlength(word, font=font) > width and len(word) > 1:  # a word wider than a line
            cut = max(1, int(len(word) * width / draw.textlength(word, font=font)))
            lines.append(word[:cut])
            word = word[cut:]
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines or [""]


def grid(images: Sequence[Image.Image | torch.Tensor], captions: Sequence[str] | None = None, *,
         columns: int = 4, cell: int = 128) -> Image.Image:
    """The images in rows of ``columns``, each scaled (nearest neighbour, so pixels stay sharp) to fit a
    ``cell`` x ``cell`` square; with ``captions`` (one per image), each caption is written, wrapped, under
    its image. -> one RGB image on a white background."""
    pics = [_rgb(to_pil(im) if isinstance(im, torch.Tensor) else im) for im in images]
    if not pics:
        raise ValueError("a grid needs at least one image")
    if captions is not None and len(captions) != len(pics):
        raise ValueError(f"{len(captions)} captions for {len(pics)} images")
    columns = max(1, min(columns, len(pics)))
    rows = -(-len(pics) // columns)
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    wrapped = [_wrap(measure, c, font, cell) for c in captions] if captions is not None else None
    line_h = measure.textbbox((0, 0), "Ag", font=font)[3] + 2
    text_h = max(len(lines) for lines in wrapped) * line_h + _PAD if wrapped else 0
    cell_w, cell_h = cell + _PAD, cell + text_h + _PAD
    out = Image.new("RGB", (columns * cell_w + _PAD, rows * cell_h + _PAD), "white")
    draw = ImageDraw.Draw(out)
    for i, pic in enumerate(pics):
        x, y = _PAD + (i % columns) * cell_w, _PAD + (i // columns) * cell_h
        scale = cell / max(pic.size)
        size = (max(1, round(pic.width * scale)), max(1, round(pic.height * scale)))
        out.paste(pic.resize(size, Image.Resampling.NEAREST), (x, y))
        for j, line in enumerate(wrapped[i] if wrapped else []):
            draw.text((x, y + cell + _PAD // 2 + j * line_h), line, fill="black", font=font)
    return out
