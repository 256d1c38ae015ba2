"""Small image folders made with Pillow for the tests (no image is committed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("cat", "dog", "ship")


def noise(shape, seed: int, low: int = 0, high: int = 256) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high, shape, dtype=np.uint8)


def make_folder(root: Path, per_class: dict[str, int], classes=CLASSES, size=(40, 30), seed: int = 0) -> Path:
    """``root/SPLIT/CLASS/i.{jpg,png}`` for each split in ``per_class`` (its count per class); each class's images
    lie in a band of brightness of their own, so a model can learn them."""
    for s, (split, n) in enumerate(per_class.items()):
        for c, name in enumerate(classes):
            folder = root / split / name if split else root / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w, h = size[0] + i % 7, size[1] + i % 5  # sizes differ: nothing assumes one
                image = Image.fromarray(noise((h, w, 3), seed * 1000 + s * 100 + c * 10 + i, 60 * c, 60 * c + 90))
                image.save(folder / f"{i:03d}.{'png' if i % 3 == 0 else 'jpg'}")
    return root


def make_coded(root: Path, per_class: int, classes=CLASSES, side: int = 8) -> Path:
    """``root/CLASS/i.png``: lossless images of one colour each, (k % 256, k // 256, 0) for the k-th file over all
    classes, so a decoded pixel says which file it came from (``code``)."""
    k = 0
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.zeros((side, side, 3), np.uint8)
            pixels[..., 0], pixels[..., 1] = k % 256, k // 256
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")
            k += 1
    return root


def code(images: np.ndarray) -> np.ndarray:
    """The file number ``make_coded`` painted into each image."""
    return images[:, 0, 0, 0].astype(np.int64) + 256 * images[:, 0, 0, 1].astype(np.int64)
