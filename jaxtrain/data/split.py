"""A whole split of an image-classification dataset, in memory."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class Split:
    """uint8 images [N, H, W, C] and int32 labels [N] (``num_classes``: from the dataset's metadata)."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int = 10

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    def head(self, n: int | None) -> "Split":
        """The first ``n`` examples (all of them for None)."""
        return self if n is None else dataclasses.replace(self, images=self.images[:n], labels=self.labels[:n])


def split_digest(*splits: Split) -> str:
    """sha256 of the examples themselves (images, then labels, split by split): what a run trained on."""
    h = hashlib.sha256()
    for split in splits:
        h.update(np.ascontiguousarray(split.images).tobytes())
        h.update(np.ascontiguousarray(split.labels).tobytes())
    return h.hexdigest()


def files_digest(paths) -> str:
    """sha256 over files' names and bytes (what a cached conversion of local files is keyed by)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
