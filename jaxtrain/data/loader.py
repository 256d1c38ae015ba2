"""Batches of an in-memory split with grain: seeded shuffle, process shard, pad for eval.

A whole split is small, so it is read once (a TFDS data source read a record at
a time is far slower: docs/data.md) and grain maps batch indices to batches:
``MapDataset.range(batches).map(make_batch)``, with worker threads when
``workers > 0``. The epoch's order depends only on (seed, epoch), never
on the device or process count; each process builds only its rows of every
global batch (the contiguous slice its devices hold).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grain
import numpy as np

from jaxtrain.data import augment as augment_lib
from jaxtrain.data.split import Split
from jaxtrain.errors import ConfigError


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1] (d2l's ToTensor)."""
    return images.astype(np.float32) * np.float32(1 / 255)


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of one epoch: depends only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


class Loader:
    """This process's share of each global batch, as dicts of numpy arrays.

    Training (``train=True``): shuffled per epoch, remainder dropped.
    Evaluation: in order, every example exactly once; the last global batch
    is padded to full size and carries ``mask`` (0 for padding).
    ``workers``: grain worker threads building batches ahead (0: in the
    caller's thread). ``augment``: "crop+flip" on training batches
    (``jaxtrain.data.augment``); ``transform``: an extra per-batch function;
    both run in the workers.
    """

    def __init__(self, split: Split, batch_size: int, *, train: bool, seed: int = 0, workers: int = 0,
                 process_index: int | None = None, process_count: int | None = None,
                 transform: Callable[[dict], dict] | None = None, augment: str = "none"):
        import jax

        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if batch_size < 1 or batch_size % self.process_count:
            raise ConfigError(f"batch size {batch_size} does not split over {self.process_count} processes: "
                              f"use a multiple of {self.process_count}")
        if workers < 0:
            raise ConfigError(f"workers={workers}: must be >= 0")
        if train and len(split) < batch_size:
            raise ConfigError(f"batch size {batch_size} is larger than the {len(split)} training examples")
        self.split, self.batch_size, self.train, self.seed = split, batch_size, train, seed
        self.workers, self.transform = workers, transform
        self.augment = augment_lib.get(augment) if train else None  # never on evaluation batches

    def __len__(self) -> int:
        """Global batches per epoch."""
        n = len(self.split)
        return n // self.batch_size if self.train else -(-n // self.batch_size)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def dataset(self, epoch: int, start: int = 0) -> grain.MapDataset:
        """Batches ``start..`` of ``epoch`` as a grain MapDataset (random access)."""
        order = epoch_order(len(self.split), self.seed, epoch) if self.train else None
        return grain.MapDataset.range(start, len(self)).map(lambda b: self._batch(order, b, epoch))

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """Iterate over one epoch from batch ``start`` (a resumed run starts mid-epoch)."""
        # Explicit options: iterating a MapDataset directly would start grain's
        # default 16 threads, whatever ``workers`` says.
        options = grain.ReadOptions(num_threads=self.workers, prefetch_buffer_size=2 * self.workers)
        return iter(self.dataset(epoch, start).to_iter_dataset(options))

    def _batch(self, order: np.ndarray | None, b: int, epoch: int) -> dict:
        bs, n = self.batch_size, len(self.split)
        lo, hi = (b * bs + self.process_index * self.local_batch_size,
                  b * bs + (self.process_index + 1) * self.local_batch_size)
        if order is not None:
            idx = order[lo:hi]
            images = self.split.images[idx]
            if self.augment is not None:
                images = self.augment(images, self.seed, epoch, idx)
            batch = {"image": normalise(images), "label": self.split.labels[idx]}
        else:  # eval: in order, padded past the end, masked
            idx = np.arange(lo, hi)
            real = idx < n
            idx = np.where(real, idx, 0)
            batch = {"image": normalise(self.split.images[idx]), "label": self.split.labels[idx], "mask": real}
        return self.transform(batch) if self.transform is not None else batch
