"""Training-time augmentation: random crops of the zero-padded image and horizontal flips.

Every random choice is a hash of (seed, epoch, example index): never of
the process, device, worker or the position in a resumed run, so a resumed
or multi-process run sees exactly the batches of one uninterrupted run.
It runs on uint8 batches in the loader's workers (``--workers``).
"""

from __future__ import annotations

import numpy as np

from jaxtrain.choices import AUGMENTATIONS
from jaxtrain.errors import ConfigError, named

PAD = 4
# splitmix64's constants (``on_device`` computes the same hash on the devices)
M1, M2, GAMMA = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: 64 well-mixed bits from 64 (wrapping uint64 arithmetic)."""
    x = (x + GAMMA).astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * M1
    x = (x ^ (x >> np.uint64(27))) * M2
    return x ^ (x >> np.uint64(31))


def random_bits(seed: int, epoch: int, index: np.ndarray) -> np.ndarray:
    """64 random bits per example, a function of (seed, epoch, example index) only."""
    with np.errstate(over="ignore"):
        key = _mix(_mix(np.uint64(seed % 2**64)) ^ np.uint64(epoch))
        return _mix(key ^ np.asarray(index, np.uint64))


def crop_flip(images: np.ndarray, seed: int, epoch: int, index: np.ndarray, pad: int = PAD) -> np.ndarray:
    """Each image [H, W, C] zero-padded by ``pad``, cropped back to H x W at a random offset (0..2*pad each way),
    flipped left-right with probability 1/2."""
    n, h, w, _ = images.shape
    bits = random_bits(seed, epoch, index)
    dy = (bits % np.uint64(2 * pad + 1)).astype(np.intp)
    dx = ((bits >> np.uint64(16)) % np.uint64(2 * pad + 1)).astype(np.intp)
    flip = ((bits >> np.uint64(32)) & np.uint64(1)).astype(bool)
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    rows = dy[:, None] + np.arange(h)
    cols = dx[:, None] + np.where(flip[:, None], np.arange(w)[::-1], np.arange(w))
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


def get(name: str):
    """``name`` -> fn(images uint8 [B, H, W, C], seed, epoch, index [B]) -> images, or None for "none"
    (``rrc+flip`` crops before decoding: only image folders have it, ``jaxtrain.data.images``)."""
    if name not in AUGMENTATIONS:
        raise ConfigError(f"unknown augmentation {name!r}: use one of {', '.join(AUGMENTATIONS)}")
    if name == "rrc+flip":
        raise ConfigError(f"{named('augment', 'rrc+flip')} crops each image before it is decoded: it is for image "
                          f"folders ({named('dataset', 'folder:DIR')}); use crop+flip for a dataset held in memory")
    return {"none": None, "crop+flip": crop_flip}[name]
