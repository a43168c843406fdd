"""The pixel reader of bench/dalle_eval.py: right on rendered shapes, at chance against shuffled captions.

The evaluation's numbers mean something only if the reader itself reads images correctly; these tests check
it on ``shapes.render`` output (crisp, and with added noise, which is closer to what a dVAE decodes), and
that the scoring does not credit images with captions they do not show."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from efftx.data import shapes

_spec = importlib.util.spec_from_file_location("dalle_eval", Path(__file__).parents[1] / "bench" / "dalle_eval.py")
dalle_eval = importlib.util.module_from_spec(_spec)
sys.modules["dalle_eval"] = dalle_eval  # its dataclasses look their module up
_spec.loader.exec_module(dalle_eval)


def some_captions(n: int, seed: int) -> list[shapes.ShapeCaption]:
    caps = shapes.captions("all")
    return [caps[i] for i in np.random.default_rng(seed).choice(len(caps), n, replace=False)]


def rendered(caps, side: int, noise: float = 0.0) -> list[np.ndarray]:
    """Each caption drawn as the training data is (jittered), plus Gaussian pixel noise of std ``noise``."""
    out = []
    for i, c in enumerate(caps):
        img = np.asarray(shapes.render(c, side, np.random.default_rng([7, i]))).astype(np.float32)
        img += np.random.default_rng(i).normal(0, noise, img.shape) if noise else 0
        out.append(img.clip(0, 255).round().astype(np.uint8))
    return out


@pytest.mark.parametrize("side", [32, 64])
def test_reads_rendered_shapes(side):
    caps = some_captions(50, seed=side)
    acc = dalle_eval.accuracy([dalle_eval.read_image(im) for im in rendered(caps, side)], caps)
    assert all(acc[a] >= 0.95 for a in (*dalle_eval.ATTRIBUTES, "colours")), acc


def test_colours_survive_pixel_noise():
    caps = some_captions(50, seed=1)
    acc = dalle_eval.accuracy([dalle_eval.read_image(im) for im in rendered(caps, 32, noise=25.0)], caps)
    assert acc["colour"] >= 0.95 and acc["background"] >= 0.95, acc


def test_shuffled_captions_score_near_chance():
    caps = some_captions(200, seed=2)
    readings = [dalle_eval.read_image(im) for im in rendered(caps, 32)]
    perm = dalle_eval.derangement(len(caps), seed=3)
    assert (perm != np.arange(len(caps))).all() and sorted(perm) == list(range(len(caps)))
    acc = dalle_eval.accuracy(readings, [caps[j] for j in perm])
    uniform, _ = dalle_eval.chance(caps)
    # 200 draws: chance +- ~4 standard deviations
    for a in ("colour", "background", "shape", "position"):
        assert abs(acc[a] - uniform[a]) < 0.13, (a, acc[a], uniform[a])
    assert acc["colours"] < 0.1


def test_reader_accepts_tensors_and_images_alike():
    import torch

    cap = shapes.ShapeCaption("triangle", "yellow", "blue", "large", "lower right")
    img = shapes.render(cap, 32)
    tensor = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
    assert dalle_eval.read_image(img) == dalle_eval.read_image(tensor) == dalle_eval.Reading(
        "yellow", "blue", "triangle", "large", "lower right")


def test_blank_image_reads_as_no_shape():
    reading = dalle_eval.read_image(np.full((32, 32, 3), shapes.COLOURS["green"], dtype=np.uint8))
    assert reading == dalle_eval.Reading(None, "green", None, None, None)
    cap = shapes.ShapeCaption("circle", "red", "green", "small", "center")
    assert dalle_eval.accuracy([reading], [cap])["background"] == 1.0
    assert dalle_eval.accuracy([reading], [cap])["colour"] == 0.0


def test_chance_levels():
    caps = [shapes.ShapeCaption("circle", "red", "blue", "small", "center"),
            shapes.ShapeCaption("square", "red", "green", "large", "center"),
            shapes.ShapeCaption("circle", "white", "blue", "small", "upper left")]
    uniform, majority = dalle_eval.chance(caps)
    assert uniform["colour"] == pytest.approx(1 / 7) and uniform["position"] == pytest.approx(1 / 5)
    assert uniform["colours"] == pytest.approx(1 / 42)
    assert majority["colour"] == pytest.approx(2 / 3) and majority["shape"] == pytest.approx(2 / 3)
    assert majority["colours"] == pytest.approx(1 / 3)
