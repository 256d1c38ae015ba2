"""Datasets as TFDS data sources: local IDX files (converted once) or TFDS's own.

Resolution order for ``fashion_mnist`` / ``mnist``:
  (a) the four IDX files in ``idx_dir`` (default for fashion_mnist: the Debian
      package's ``/usr/share/datasets/fashion-mnist``), converted ONCE by our
      small TFDS builder into array_record in the TFDS data dir. The cached
      copy is keyed by the sha256 of the four files' bytes (config
      ``NAME_<12 hex digits>``): other or damaged files are never mistaken
      for a copy made earlier; they are validated and converted anew;
  (b) TFDS's own prepared (or downloadable) dataset;
  (c) otherwise a ConfigError that lists the ways to get the data.
No TensorFlow is needed: images are stored as uint8 tensors, not PNGs.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import os
import struct
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

from jaxtrain.errors import ConfigError

DATASETS = ("fashion_mnist", "mnist")
DEFAULT_IDX_DIRS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10
_HOW_TO_GET = (
    "get it with `make data` (Debian package dataset-fashion-mnist), or pass --data-dir DIR "
    "holding the four IDX files (train-images-idx3-ubyte[.gz], ...), or let TFDS download it (needs internet)"
)


@dataclasses.dataclass(frozen=True)
class Split:
    """A whole split in memory: uint8 images [N, 28, 28, 1] and int32 labels [N]."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, n: int | None) -> "Split":
        """The first ``n`` examples (all of them for None)."""
        return self if n is None else Split(self.images[:n], self.labels[:n])


# ---------------------------------------------------------------- IDX files


def find_idx_file(idx_dir: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (idx_dir / name).is_file():
            return idx_dir / name
    return None


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


def read_idx_split(idx_dir: Path, split: str) -> Split:
    """Read and validate one split (images and labels) from IDX files."""
    image_stem, label_stem = IDX_FILES[split]
    paths = [find_idx_file(idx_dir, image_stem), find_idx_file(idx_dir, label_stem)]
    for stem, path in zip((image_stem, label_stem), paths):
        if path is None:
            raise ConfigError(f"{idx_dir}: {stem}[.gz] is missing; {_HOW_TO_GET}")
    images, labels = read_idx(paths[0], 3), read_idx(paths[1], 1)
    if images.shape[1:] != IMAGE_SHAPE[:2]:
        raise ConfigError(f"{paths[0]}: images are {images.shape[1]}x{images.shape[2]}, expected 28x28")
    if len(images) != len(labels):
        raise ConfigError(f"{paths[0]} holds {len(images)} images but {paths[1]} holds {len(labels)} labels")
    if labels.size and labels.max() >= NUM_CLASSES:
        raise ConfigError(f"{paths[1]}: label {labels.max()} found, expected labels 0-9")
    return Split(images.reshape(-1, *IMAGE_SHAPE), labels.astype(np.int32))


def has_idx_files(idx_dir: Path) -> bool:
    return all(find_idx_file(idx_dir, stem) for pair in IDX_FILES.values() for stem in pair)


def idx_files_digest(idx_dir: Path) -> str:
    """sha256 over the four IDX files' names and bytes (what a cached conversion is keyed by)."""
    h = hashlib.sha256()
    for stem in (stem for pair in IDX_FILES.values() for stem in pair):
        path = find_idx_file(idx_dir, stem)
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def split_digest(*splits: Split) -> str:
    """sha256 of the examples themselves (images, then labels, split by split): what a run trained on."""
    h = hashlib.sha256()
    for split in splits:
        h.update(np.ascontiguousarray(split.images).tobytes())
        h.update(np.ascontiguousarray(split.labels).tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- TFDS


@functools.cache
def _builder_class():
    """Our TFDS builder, defined lazily (once) so that importing jaxtrain stays cheap."""
    import logging

    import tensorflow_datasets as tfds

    # Our configs are made per set of source files on purpose: not worth a warning each run.
    logging.getLogger("absl").addFilter(lambda r: not r.getMessage().startswith("Using custom data configuration"))

    class JaxtrainIdxImages(tfds.core.GeneratorBasedBuilder):
        """28x28 grayscale IDX datasets (fashion_mnist, mnist) read from local files."""

        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS = []  # one config per set of source files: NAME_<digest>, see data_source
        MANUAL_DOWNLOAD_INSTRUCTIONS = "Put the four IDX files in the manual dir."

        def _info(self):
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict(
                    {
                        "image": tfds.features.Tensor(shape=IMAGE_SHAPE, dtype=np.uint8),
                        "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
                    }
                ),
                supervised_keys=("image", "label"),
            )

        def _split_generators(self, dl_manager):
            idx_dir = Path(dl_manager.manual_dir)
            return {split: self._generate_examples(read_idx_split(idx_dir, split)) for split in IDX_FILES}

        def _generate_examples(self, split: Split):
            for i in range(len(split)):
                yield i, {"image": split.images[i], "label": int(split.labels[i])}

    return JaxtrainIdxImages


def _process_index() -> int:
    import jax

    return jax.process_index() if jax.distributed.is_initialized() else 0


def _wait_until_prepared(make_builder, timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        builder = make_builder()
        if builder.is_prepared():
            return builder
        time.sleep(0.5)
    raise ConfigError(f"process 0 did not finish converting the dataset within {timeout:.0f} s")


def _read_source(source) -> Split:
    """Read a whole TFDS data source into memory, in large chunks (fast path)."""
    n, chunk = len(source), 8192
    images = np.empty((n, *IMAGE_SHAPE), np.uint8)
    labels = np.empty((n,), np.int32)
    for start in range(0, n, chunk):
        records = source.__getitems__(list(range(start, min(n, start + chunk))))
        images[start : start + len(records)] = np.stack([np.asarray(r["image"]).reshape(IMAGE_SHAPE) for r in records])
        labels[start : start + len(records)] = [int(r["label"]) for r in records]
    return Split(images, labels)


def data_source(name: str, split: str, *, idx_dir: str | os.PathLike | None = None, tfds_dir=None, download=True):
    """The TFDS data source of ``name``/``split``, by the resolution order above."""
    import tensorflow_datasets as tfds

    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)}")
    if split not in IDX_FILES:
        raise ConfigError(f"unknown split {split!r}: use train or test")
    explicit = idx_dir is not None
    idx_path = Path(idx_dir if explicit else DEFAULT_IDX_DIRS[name])
    if explicit and not idx_path.is_dir():
        raise ConfigError(f"--data-dir {idx_path} is not a directory; {_HOW_TO_GET}")
    if has_idx_files(idx_path) or explicit:
        for stem in (stem for pair in IDX_FILES.values() for stem in pair):
            if find_idx_file(idx_path, stem) is None:
                raise ConfigError(f"{idx_path}: {stem}[.gz] is missing; {_HOW_TO_GET}")
        config = tfds.core.BuilderConfig(name=f"{name}_{idx_files_digest(idx_path)[:12]}",
                                         description=f"{name} from the IDX files in {idx_path}")

        def make_builder():
            return _builder_class()(config=config, data_dir=tfds_dir)

        builder = make_builder()
        if not builder.is_prepared():
            if _process_index() > 0:  # in a multi-process run, process 0 converts; the others wait
                builder = _wait_until_prepared(make_builder)
            else:
                for s in IDX_FILES:  # validate before writing anything
                    read_idx_split(idx_path, s)
                print(f"converting the IDX files in {idx_path} to array_record (once) ...", file=sys.stderr, flush=True)
                builder.download_and_prepare(
                    download_config=tfds.download.DownloadConfig(manual_dir=str(idx_path)), file_format="array_record"
                )
        return builder.as_data_source(split=split)
    builder = tfds.builder(name, data_dir=tfds_dir)
    if not builder.is_prepared():
        if not download:
            raise ConfigError(f"dataset {name} not found (no IDX files in {idx_path}, no prepared TFDS copy); {_HOW_TO_GET}")
        try:
            builder.download_and_prepare(file_format="array_record")
        except Exception as e:  # noqa: BLE001 - any failure here means "no data"
            raise ConfigError(
                f"dataset {name} not found (no IDX files in {idx_path}) and TFDS could not download it "
                f"({type(e).__name__}); {_HOW_TO_GET}"
            ) from None
    return builder.as_data_source(split=split, file_format="array_record")


def load_split(name: str, split: str, **kwargs) -> Split:
    """The whole split in memory (47 MB for Fashion-MNIST train: cheap to keep).

    Decoding 60,000 TFDS records one by one takes seconds, so the arrays are
    also kept beside the prepared dataset (``SPLIT-arrays.npz``, with their
    sha256, checked on every read); a missing, damaged or unwritable copy
    just means reading the records again.
    """
    source = data_source(name, split, **kwargs)
    cache = Path(source.dataset_info.data_dir) / f"jaxtrain-{split}-arrays.npz"
    try:
        with np.load(cache) as f:
            arrays = Split(f["images"], f["labels"])
            if len(arrays) == len(source) and str(f["sha256"]) == split_digest(arrays):
                return arrays
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass
    arrays = _read_source(source)
    if _process_index() == 0:
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, images=arrays.images, labels=arrays.labels, sha256=split_digest(arrays))
            os.replace(tmp, cache)
        except OSError:  # a read-only TFDS dir: fine, only slower next time
            tmp.unlink(missing_ok=True)
    return arrays
