"""IDX -> TFDS array_record -> memory, its validation, and the loader."""

import gzip
import struct

import numpy as np
import pytest
from conftest import FASHION_MNIST_DIR, needs_fashion_mnist

from jaxtrain import ConfigError
from jaxtrain.data import idx, loader, sources


def write_idx(path, array, gz):
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def make_idx_dir(root, gz=True, n_train=40, n_test=12, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        img_stem, lbl_stem = idx.FILES[split]
        suffix = ".gz" if gz else ""
        write_idx(root / (img_stem + suffix), images, gz)
        write_idx(root / (lbl_stem + suffix), labels, gz)
        arrays[split] = (images, labels)
    return arrays


def as_sorted_pairs(images, labels):
    """Rows as (image bytes, label), sorted: TFDS shuffles when it prepares."""
    return sorted((im.tobytes(), int(lb)) for im, lb in zip(images.reshape(len(labels), -1), labels))


@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_convert_once_and_read_back(tmp_path, gz):
    idx_dir, tfds_dir = tmp_path / "idx", tmp_path / "tfds"
    arrays = make_idx_dir(idx_dir, gz=gz)
    for split, (images, labels) in arrays.items():
        got = sources.load_split("fashion_mnist", split, data_dir=idx_dir, tfds_dir=tfds_dir)
        assert got.images.shape == (len(labels), 28, 28, 1) and got.images.dtype == np.uint8
        assert got.labels.dtype == np.int32
        assert as_sorted_pairs(got.images, got.labels) == as_sorted_pairs(images, labels)
    prepared = list(tfds_dir.glob("*/fashion_mnist_*/1.0.0/*.array_record*"))
    assert prepared, "expected array_record files in the TFDS data dir"
    # Converted once: reading again leaves the converted files alone.
    stamps = {p: p.stat().st_mtime_ns for p in prepared}
    again = sources.load_split("fashion_mnist", "test", data_dir=idx_dir, tfds_dir=tfds_dir)
    assert len(again) == 12
    assert {p: p.stat().st_mtime_ns for p in prepared} == stamps


def test_other_idx_files_are_never_served_from_an_earlier_conversion(tmp_path):
    """Issue 20 (1): the cache was keyed by the dataset name only."""
    idx_dir, tfds_dir = tmp_path / "idx", tmp_path / "tfds"
    make_idx_dir(idx_dir, n_train=40)
    assert len(sources.load_split("fashion_mnist", "train", data_dir=idx_dir, tfds_dir=tfds_dir)) == 40
    other = make_idx_dir(idx_dir, n_train=24, seed=1)  # same directory, other files
    got = sources.load_split("fashion_mnist", "train", data_dir=idx_dir, tfds_dir=tfds_dir)
    assert as_sorted_pairs(got.images, got.labels) == as_sorted_pairs(*other["train"])
    raw = (idx_dir / "train-images-idx3-ubyte.gz").read_bytes()
    (idx_dir / "train-images-idx3-ubyte.gz").write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte.gz"):
        sources.load_split("fashion_mnist", "train", data_dir=idx_dir, tfds_dir=tfds_dir)
    for f in idx_dir.iterdir():  # gone: nothing to vouch for a cached copy
        f.unlink()
    with pytest.raises(ConfigError, match="is missing"):
        sources.load_split("fashion_mnist", "train", data_dir=idx_dir, tfds_dir=tfds_dir)


def corrupt(idx_dir, stem, data: bytes):
    (idx_dir / (stem + ".gz")).write_bytes(gzip.compress(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: corrupt(d, "train-images-idx3-ubyte", b"\x00\x00\x08\x01" + b"\x00" * 8),
         "train-images-idx3-ubyte.gz: not an IDX"),
        (lambda d: corrupt(d, "t10k-labels-idx1-ubyte", struct.pack(">II", 0x801, 12) + b"\x01" * 5),
         "t10k-labels-idx1-ubyte.gz: header says 12"),
        (lambda d: corrupt(d, "t10k-labels-idx1-ubyte", struct.pack(">II", 0x801, 12) + b"\x0b" * 12),
         "label 11 found"),
        (lambda d: corrupt(d, "train-labels-idx1-ubyte", struct.pack(">II", 0x801, 7) + b"\x01" * 7),
         "holds 40 images but"),
        (lambda d: corrupt(d, "train-images-idx3-ubyte", struct.pack(">IIII", 0x803, 40, 32, 32) + b"\x00" * 40 * 1024),
         "32x32, expected 28x28"),
        (lambda d: (d / "t10k-images-idx3-ubyte.gz").unlink(), "t10k-images-idx3-ubyte\\[.gz\\] is missing"),
        (lambda d: (d / "train-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8bnot gzip"), "not a readable gzip"),
    ],
)
def test_bad_idx_files_name_the_file(tmp_path, damage, message):
    idx_dir = tmp_path / "idx"
    make_idx_dir(idx_dir)
    damage(idx_dir)
    with pytest.raises(ConfigError, match=message):
        sources.load_split("fashion_mnist", "train", data_dir=idx_dir, tfds_dir=tmp_path / "tfds")
    assert not list((tmp_path / "tfds").glob("**/*.array_record*")), "nothing may be written from bad files"


def test_missing_data_lists_the_ways_to_get_it(tmp_path, monkeypatch):
    """Each dataset's own ways: `make data` installs Fashion-MNIST's Debian package, not MNIST's (it has none)."""
    monkeypatch.setitem(sources.DEFAULT_DATA_DIRS, "mnist", str(tmp_path / "nowhere"))
    monkeypatch.setitem(sources.DEFAULT_DATA_DIRS, "fashion_mnist", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="make data.*data_dir=.*TFDS download"):
        sources.load_split("fashion_mnist", "train", tfds_dir=tmp_path / "tfds", download=False)
    with pytest.raises(ConfigError, match="data_dir=.*TFDS download") as e:
        sources.load_split("mnist", "train", tfds_dir=tmp_path / "tfds", download=False)
    assert "make data" not in str(e.value)
    with pytest.raises(ConfigError, match="not a directory"):
        sources.load_split("mnist", "train", data_dir=tmp_path / "nowhere", tfds_dir=tmp_path / "tfds")
    with pytest.raises(ConfigError, match="unknown dataset"):
        sources.load_split("cifar100", "train")


@needs_fashion_mnist
def test_real_fashion_mnist(tfds_dir):
    train = sources.load_split("fashion_mnist", "train", tfds_dir=tfds_dir)
    test = sources.load_split("fashion_mnist", "test", tfds_dir=tfds_dir)
    assert (len(train), len(test)) == (60000, 10000)
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert np.bincount(test.labels).tolist() == [1000] * 10
    direct = idx.read_split(FASHION_MNIST_DIR, "test")
    assert as_sorted_pairs(test.images, test.labels) == as_sorted_pairs(direct.images, direct.labels)


def test_loader_train_and_eval_batches():
    split = sources.Split(np.arange(10 * 784, dtype=np.uint8).reshape(10, 28, 28, 1) % 251,
                          np.arange(10, dtype=np.int32))
    train = loader.Loader(split, 4, train=True, seed=3)
    batches = list(train.epoch(1))
    assert len(train) == len(batches) == 2  # remainder dropped
    seen = np.concatenate([b["label"] for b in batches])
    assert len(set(seen.tolist())) == 8
    assert batches[0]["image"].dtype == np.float32 and 0 <= batches[0]["image"].min() <= batches[0]["image"].max() <= 1
    assert np.array_equal(seen, np.concatenate([b["label"] for b in train.epoch(1)]))  # (seed, epoch) fixes order
    assert not np.array_equal(seen, np.concatenate([b["label"] for b in train.epoch(2)]))
    ev = list(loader.Loader(split, 4, train=False).epoch(1))
    assert [b["mask"].sum() for b in ev] == [4, 4, 2]
    assert all(len(b["label"]) == 4 for b in ev)


def test_in_memory_copy_is_checked_and_rebuilt_when_damaged(tmp_path):
    idx_dir, tfds_dir = tmp_path / "idx", tmp_path / "tfds"
    arrays = make_idx_dir(idx_dir)
    first = sources.load_split("fashion_mnist", "train", data_dir=idx_dir, tfds_dir=tfds_dir)
    [cache] = tfds_dir.glob("*/fashion_mnist_*/1.0.0/jaxtrain-train-arrays.npz")
    raw = bytearray(cache.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the images
    cache.write_bytes(bytes(raw))
    again = sources.load_split("fashion_mnist", "train", data_dir=idx_dir, tfds_dir=tfds_dir)
    assert np.array_equal(again.images, first.images) and np.array_equal(again.labels, first.labels)
    assert as_sorted_pairs(again.images, again.labels) == as_sorted_pairs(*arrays["train"])
    with np.load(cache) as f:  # rewritten whole
        assert np.array_equal(f["images"], first.images)


@pytest.mark.parametrize("images, labels, says", [
    (np.zeros((4, 28, 28, 1), np.uint8), np.array([0, 1, 10, 2]), r"labels must lie in 0..9 \(10 classes\), got 0..10"),
    (np.zeros((4, 28, 28, 1), np.uint8), np.array([0, -1, 3, 2]), r"got -1..3"),
    (np.zeros((4, 28, 28, 1), np.float32), np.zeros(4, np.int32), r"images must be uint8 \[N, H, W, C\].*float32"),
    (np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int32),
     r"a channel axis even for grey\), got uint8 \[4, 28, 28\]"),
    (np.zeros((4, 28, 28, 1), np.uint8), np.zeros(3, np.int32), r"labels must be integers \[N\] with N = 4 images"),
    (np.zeros((4, 28, 28, 1), np.uint8), np.zeros(4, np.float32), r"labels must be integers"),
])
def test_a_split_with_bad_arrays_is_a_one_line_error(images, labels, says):
    """Labels >= the class count trained to a silent NaN loss; a wrong image shape or dtype gave raw JAX errors."""
    with pytest.raises(ConfigError, match=says):
        sources.Split(images, labels)
