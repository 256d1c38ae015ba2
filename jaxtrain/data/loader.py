"""Batches from a split held in memory: seeded shuffle, normalise, pad for eval."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxtrain.data.sources import Split


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1] (d2l's ToTensor)."""
    return images.astype(np.float32) * np.float32(1 / 255)


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of one epoch: depends only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


class Loader:
    """Global batches of one split as dicts of numpy arrays.

    Training (``train=True``): shuffled per epoch, remainder dropped.
    Evaluation: in order, every example exactly once; the last batch is padded
    to full size and carries ``mask`` (0 for padding) so metrics ignore it.
    """

    def __init__(self, split: Split, batch_size: int, *, train: bool, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        self.split, self.batch_size, self.train, self.seed = split, batch_size, train, seed

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.split)
        return n // self.batch_size if self.train else -(-n // self.batch_size)

    def epoch(self, epoch: int) -> Iterator[dict]:
        n, bs = len(self.split), self.batch_size
        order = epoch_order(n, self.seed, epoch) if self.train else np.arange(n)
        for i in range(len(self)):
            idx = order[i * bs : (i + 1) * bs]
            batch = {"image": normalise(self.split.images[idx]), "label": self.split.labels[idx]}
            if not self.train:
                batch = _pad(batch, bs)
            yield batch


def _pad(batch: dict, size: int) -> dict:
    real = len(batch["label"])
    padded = {k: np.concatenate([v, np.zeros((size - real, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
    padded["mask"] = np.arange(size) < real
    return padded
