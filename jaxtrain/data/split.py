"""A whole split of an image-classification dataset, in memory."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from jaxtrain.errors import ConfigError


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1] (d2l's ToTensor)."""
    return images.astype(np.float32) * np.float32(1 / 255)


@dataclasses.dataclass(frozen=True)
class Split:
    """uint8 images [N, H, W, C] and int32 labels [N] (``num_classes``: from the dataset's metadata)."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int = 10

    def __post_init__(self):
        """Bad arrays are a one-line error here, not a raw JAX error (or a silent NaN loss) in the first step."""
        images, labels = np.asarray(self.images), np.asarray(self.labels)
        if images.dtype != np.uint8 or images.ndim != 4:
            raise ConfigError(f"images must be uint8 [N, H, W, C] (pixels 0-255; a channel axis even for grey), got "
                              f"{images.dtype} {list(images.shape)}")
        if labels.ndim != 1 or len(labels) != len(images) or not np.issubdtype(labels.dtype, np.integer):
            raise ConfigError(f"labels must be integers [N] with N = {len(images)} images, got {labels.dtype} "
                              f"{list(labels.shape)}")
        if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ConfigError(f"labels must lie in 0..{self.num_classes - 1} ({self.num_classes} classes), got "
                              f"{labels.min()}..{labels.max()}: pass the right num_classes")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    raw = False  # batches go to the devices as float32 in [0, 1] (the loader normalises them)

    def examples(self, idx: np.ndarray, augment: str | None, seed: int, epoch: int) -> tuple[np.ndarray, list, list]:
        """(uint8 images ``idx``, [], []), a training batch's ``augment`` applied (None: evaluation)."""
        from jaxtrain.data import augment as augment_lib

        images = self.images[idx]
        fn = augment_lib.get(augment) if augment else None
        return (images if fn is None else fn(images, seed, epoch, idx)), [], []

    def rows(self, idx: np.ndarray, *, train: bool, augment: str | None, seed: int,
             epoch: int) -> tuple[dict, list, list]:
        """({"image": float32 in [0, 1], "label"} of examples ``idx``, [], []): what the loader sends of them."""
        images = self.examples(idx, augment if train else None, seed, epoch)[0]
        return {"image": normalise(images), "label": self.labels[idx]}, [], []

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
