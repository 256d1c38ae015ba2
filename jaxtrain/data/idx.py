"""IDX files (MNIST, Fashion-MNIST): read and validated, gzip'd or plain."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from jaxtrain.data.split import Split
from jaxtrain.errors import ConfigError, named

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


def how_to_get(name: str | None = None, download: bool = True) -> str:
    """How to get dataset ``name``'s files (said when they are missing; None: the files of a ``data_dir`` given, for
    either dataset), naming the parameter as the caller spells it; ``download``: TFDS's download is a way (not where
    it has just failed, nor for a ``data_dir`` given, which TFDS never replaces)."""
    debian = "get it with `make data` (Debian package dataset-fashion-mnist), or " if name == "fashion_mnist" else ""
    return (f"{debian}pass {named('data_dir')} holding the four IDX files (train-images-idx3-ubyte[.gz], ...)"
            + (", or let TFDS download it (needs internet)" if download else ""))


def find(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


def paths(directory: Path) -> list[Path]:
    """The four files, in a fixed order; a ConfigError naming the first one missing."""
    found = []
    for stem in (stem for pair in FILES.values() for stem in pair):
        path = find(directory, stem)
        if path is None:
            raise ConfigError(f"{directory}: {stem}[.gz] is missing; {how_to_get(download=False)}")
        found.append(path)
    return found


def present(directory: Path) -> bool:
    return all(find(directory, stem) for pair in FILES.values() for stem in pair)


def read_idx(path: Path, expect_dims: int) -> np.ndarray:
    """Read one IDX file (gzip'd or plain) and check its header against its size."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ConfigError(f"{path}: not a readable gzip file ({e}); replace it with an intact copy") from None
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08" or raw[3] != expect_dims:
        raise ConfigError(
            f"{path}: not an IDX file of uint8 with {expect_dims} dimension(s) "
            f"(magic {raw[:4].hex()}, expected 0000080{expect_dims}); replace it with an intact copy"
        )
    header = 4 + 4 * expect_dims
    dims = struct.unpack(f">{expect_dims}I", raw[4:header])
    if len(raw) - header != int(np.prod(dims)):
        raise ConfigError(
            f"{path}: header says {'x'.join(map(str, dims))} bytes of data but the file holds "
            f"{len(raw) - header}; the file is truncated or corrupt"
        )
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def read_split(directory: Path, split: str) -> Split:
    """Read and validate one split (images and labels) from IDX files."""
    image_stem, label_stem = FILES[split]
    image_path, label_path = find(directory, image_stem), find(directory, label_stem)
    for stem, path in ((image_stem, image_path), (label_stem, label_path)):
        if path is None:
            raise ConfigError(f"{directory}: {stem}[.gz] is missing; {how_to_get(download=False)}")
    images, labels = read_idx(image_path, 3), read_idx(label_path, 1)
    if images.shape[1:] != IMAGE_SHAPE[:2]:
        raise ConfigError(f"{image_path}: images are {images.shape[1]}x{images.shape[2]}, expected 28x28")
    if len(images) != len(labels):
        raise ConfigError(f"{image_path} holds {len(images)} images but {label_path} holds {len(labels)} labels")
    if labels.size and labels.max() >= NUM_CLASSES:
        raise ConfigError(f"{label_path}: label {labels.max()} found, expected labels 0-9")
    return Split(images.reshape(-1, *IMAGE_SHAPE), labels.astype(np.int32))
