"""The CIFAR-10 binary distribution (``cifar-10-batches-bin``): read and validated, no pickle.

Each file is a run of 3073-byte records: 1 label byte (0-9), then 3072
pixel bytes, channel-major (1024 red, 1024 green, 1024 blue; rows of 32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxtrain.data.split import Split
from jaxtrain.errors import ConfigError, named

FILES = {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test": ("test_batch.bin",)}
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
RECORD = 1 + 32 * 32 * 3


def how_to_get(name: str | None = None, download: bool = True) -> str:
    """How to get the files (said when they are missing), naming the parameter as the caller spells it (``name`` and
    ``download`` as ``idx.how_to_get`` takes them: one way for any case)."""
    return (f"pass {named('data_dir')} holding CIFAR-10's binary version (data_batch_1.bin ... data_batch_5.bin, "
            "test_batch.bin: the files of cifar-10-binary.tar.gz)")


def directory_of(directory: Path) -> Path:
    """``directory`` or its ``cifar-10-batches-bin`` folder (the archive's own), whichever holds the files."""
    inner = directory / "cifar-10-batches-bin"
    return inner if not (directory / FILES["test"][0]).is_file() and inner.is_dir() else directory


def paths(directory: Path) -> list[Path]:
    """The six files, in a fixed order; a ConfigError naming the first one missing."""
    directory = directory_of(directory)
    found = [directory / name for names in FILES.values() for name in names]
    for path in found:
        if not path.is_file():
            raise ConfigError(f"{directory}: {path.name} is missing; {how_to_get()}")
    return found


def present(directory: Path) -> bool:
    directory = directory_of(directory)
    return all((directory / name).is_file() for names in FILES.values() for name in names)


def read_file(path: Path) -> Split:
    """One binary batch file -> images [N, 32, 32, 3] (channels last), labels [N]."""
    raw = np.frombuffer(Path(path).read_bytes(), np.uint8)
    if raw.size == 0 or raw.size % RECORD:
        raise ConfigError(f"{path}: {raw.size} bytes is not a whole number of {RECORD}-byte CIFAR-10 records "
                          "(1 label byte + 3072 pixel bytes); the file is truncated or not CIFAR-10's binary version")
    records = raw.reshape(-1, RECORD)
    labels = records[:, 0].astype(np.int32)
    if labels.max() >= NUM_CLASSES:
        bad = int(np.argmax(labels >= NUM_CLASSES))
        raise ConfigError(f"{path}: record {bad} has label {labels[bad]}, expected 0-9; the file is corrupt or not "
                          "CIFAR-10 (CIFAR-100's binary records are 3074 bytes)")
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return Split(np.ascontiguousarray(images), labels)


def read_split(directory: Path, split: str) -> Split:
    """The train split (the five data batches, in order) or the test split, validated."""
    directory = directory_of(directory)
    parts = []
    for name in FILES[split]:
        if not (directory / name).is_file():
            raise ConfigError(f"{directory}: {name} is missing; {how_to_get()}")
        parts.append(read_file(directory / name))
    return Split(np.concatenate([p.images for p in parts]), np.concatenate([p.labels for p in parts]))
