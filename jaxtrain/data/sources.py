"""Datasets as TFDS data sources: local files (converted once), or datasets TFDS has prepared.

``fashion_mnist`` / ``mnist`` / ``cifar10``, in this order:

  (a) local files: the four IDX files (``jaxtrain.data.idx``; default for
      fashion_mnist: the Debian package's ``/usr/share/datasets/fashion-mnist``)
      or CIFAR-10's binary batches (``jaxtrain.data.cifar``) in ``data_dir``,
      converted ONCE by our small TFDS builder into array_record in the TFDS
      data dir. The cached copy is keyed by the sha256 of the files' bytes
      (config ``NAME_<12 hex digits>``): other or damaged files are never
      mistaken for a copy made earlier; they are validated and converted anew;
  (b) TFDS's own prepared (or downloadable) dataset;
  (c) otherwise a ConfigError that lists the ways to get the data.

``tfds:NAME``: any image-classification dataset TFDS has already prepared
(array_record) in the TFDS data dir; shape and classes from its metadata.
No TensorFlow is needed: our images are stored as uint8 tensors, not PNGs.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import numpy as np

from jaxtrain import settings
from jaxtrain.io import console
from jaxtrain.choices import DATASETS, DEFAULT_DATA_DIRS, TFDS_PREFIX, check_dataset
from jaxtrain.data import cifar, convert, idx
from jaxtrain.data.split import Split, files_digest, split_digest  # noqa: F401 - Split: the public home
from jaxtrain.errors import ConfigError, named

log = logging.getLogger(__name__)

LOCAL = {"fashion_mnist": idx, "mnist": idx, "cifar10": cifar}  # name -> the module reading its local files
assert tuple(LOCAL) == DATASETS


def shape_of(name: str, split: Split | None = None) -> dict:
    """``{"input_shape": (H, W, C), "num_classes": K}`` of ``split``, or (not read yet) the dataset's usual (a
    folder's: ``jaxtrain.data.datasets``)."""
    if split is not None:
        return {"input_shape": split.image_shape, "num_classes": split.num_classes}
    fmt = LOCAL.get(name, idx)  # tfds:NAME: unknown until read; checked again then
    return {"input_shape": fmt.IMAGE_SHAPE, "num_classes": fmt.NUM_CLASSES}


# ---------------------------------------------------------------- TFDS


def _keys(info) -> tuple[str, str]:
    """The (image, label) feature names of an image-classification dataset; a ConfigError otherwise."""
    image, label = info.supervised_keys if isinstance(info.supervised_keys, tuple) and len(
        info.supervised_keys) == 2 and isinstance(info.supervised_keys[0], str) else ("image", "label")
    features = info.features
    if image not in features or label not in features or not hasattr(features[label], "num_classes"):
        raise ConfigError(f"dataset {info.name} is not an image classification dataset (features "
                          f"{', '.join(features.keys())}; expected an image and a class label)")
    shape = features[image].shape
    if len(shape) != 3 or None in shape:
        raise ConfigError(f"dataset {info.name}: images of shape {shape}; jaxtrain needs one fixed HxWxC shape")
    return image, label


def _read_source(source) -> Split:
    """Read a whole TFDS data source into memory, in large chunks (fast path)."""
    info = source.dataset_info
    image, label = _keys(info)
    shape, n, chunk = tuple(info.features[image].shape), len(source), 8192
    images = np.empty((n, *shape), np.uint8)
    labels = np.empty((n,), np.int32)
    for start in range(0, n, chunk):
        records = source.__getitems__(list(range(start, min(n, start + chunk))))
        images[start : start + len(records)] = np.stack([np.asarray(r[image]).reshape(shape) for r in records])
        labels[start : start + len(records)] = [int(r[label]) for r in records]
    return Split(images, labels, info.features[label].num_classes)


def _prepared_tfds(name: str, split: str, tfds_dir):
    """``tfds:NAME``: a dataset TFDS has already prepared, read as a data source (no download, no TensorFlow)."""
    import tensorflow_datasets as tfds

    where = tfds_dir or settings.tfds_dir()
    try:
        builder = tfds.builder(name, data_dir=tfds_dir)
    except Exception as e:  # noqa: BLE001 - any failure here means "not there"
        raise ConfigError(f"tfds:{name}: no such dataset prepared in {where} ({type(e).__name__}): prepare it with "
                          f"`tfds build {name} --file_format=array_record`, or pass {named('tfds_dir')}") from None
    if not _prepared(builder):
        raise ConfigError(f"tfds:{name} is not prepared in {where}: prepare it with `tfds build {name} "
                          f"--file_format=array_record`, or pass {named('tfds_dir')}")
    if split not in builder.info.splits:
        raise ConfigError(f"tfds:{name} has no {split!r} split (it has {', '.join(builder.info.splits)})")
    _keys(builder.info)
    try:
        return builder.as_data_source(split=split)
    except Exception as e:  # noqa: BLE001 - e.g. prepared as tfrecord only
        raise ConfigError(f"tfds:{name} cannot be read as a data source ({e}); prepare it with "
                          "--file_format=array_record") from None


def _prepared(builder) -> bool:
    """``builder.is_prepared()`` without TFDS's warning "Variant folder ... has no dataset_info.json" for a dataset
    not prepared (even where no such folder is): what follows says so in one line, and what to do."""
    def variant(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Variant folder")

    absl = logging.getLogger("absl")
    absl.addFilter(variant)
    try:
        return builder.is_prepared()
    finally:
        absl.removeFilter(variant)


def data_source(name: str, split: str, *, data_dir: str | os.PathLike | None = None, tfds_dir=None, download=True):
    """The TFDS data source of ``name``/``split``, by the resolution order above."""
    import tensorflow_datasets as tfds

    check_dataset(name)
    if split not in ("train", "test"):
        raise ConfigError(f"unknown split {split!r}: use train or test")
    if name.startswith(TFDS_PREFIX):
        return _prepared_tfds(name[len(TFDS_PREFIX):], split, tfds_dir)
    fmt, local = LOCAL[name], _local_files(name, data_dir)
    if local is not None:
        return convert.converted(fmt, name, split, local, tfds_dir)
    builder = tfds.builder(name, data_dir=tfds_dir)
    if not _prepared(builder):
        where = (f"no files in {DEFAULT_DATA_DIRS[name]}" if name in DEFAULT_DATA_DIRS else
                 f"no {named('data_dir')} given")
        if not download:
            raise ConfigError(f"dataset {name} not found ({where}, no prepared TFDS copy); {fmt.how_to_get(name)}")
        if not _downloaded(builder) and (blocked := unreachable([*(builder.url_infos or ()),
                                                                   "https://storage.googleapis.com"])):
            raise ConfigError(f"dataset {name} not found ({where}) and TFDS cannot download it ({blocked}); "
                              f"{fmt.how_to_get(name, download=False)}")
        try:
            builder.download_and_prepare(file_format="array_record")
        except Exception as e:  # noqa: BLE001 - any failure here means "no data"
            raise ConfigError(f"dataset {name} not found ({where}) and TFDS could not download it "
                              f"({type(e).__name__}); {fmt.how_to_get(name, download=False)}") from None
    return builder.as_data_source(split=split, file_format="array_record")


def _downloaded(builder) -> bool:
    """Whether TFDS's download cache (``TFDS_DIR/downloads``) holds every file ``builder`` downloads: it prepares
    from them with no network (a prepare cut short, a cache copied to a node offline)."""
    try:
        from etils import epath
        from tensorflow_datasets.core.download import resource

        where = epath.Path(builder.data_dir_root) / "downloads"  # TFDS's place for them, or its older one
        return bool(builder.url_infos) and all(
            any(resource.is_locally_cached(place / resource.get_dl_fname(url, info.checksum))
                for place in (where / builder.name, where))
            for url, info in builder.url_infos.items())
    except (ImportError, AttributeError, OSError) as e:  # another TFDS's layout, or an unreadable cache
        log.warning(f"TFDS's download cache of {builder.name} could not be read ({type(e).__name__}: {e}); trying "
                    "its hosts instead")
        return False


def unreachable(urls, timeout: float = 5.0) -> str | None:
    """Why none of ``urls``' hosts (or the proxies the environment names for them) takes a connection within
    ``timeout`` seconds, in a few words; None where one does. Offline, TFDS's download retries each file ten
    times with a backoff (over a minute) before it fails: this says it in seconds."""
    reasons = []
    for host, port in dict.fromkeys(map(_connects_to, urls)):
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return None
        except OSError as e:  # refused, unresolved or no answer: the next host is tried, each one's why said
            why = e.strerror or (f"no answer in {timeout:g} s" if isinstance(e, TimeoutError) else type(e).__name__)
            reasons.append(f"{host}:{port}: {why}")
    return "no connection to " + "; ".join(reasons) if reasons else None


def _connects_to(url: str) -> tuple[str, int]:
    """(host, port) a download of ``url`` connects to: its proxy's, where the environment names one."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")  # requests takes ALL_PROXY too
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _local_files(name: str, data_dir) -> Path | None:
    """The directory of ``name``'s local files (``data_dir``, or the default one if it has them), or None."""
    fmt, explicit = LOCAL[name], data_dir is not None
    local = Path(data_dir if explicit else DEFAULT_DATA_DIRS.get(name, "/nonexistent"))
    if explicit and not local.is_dir():
        raise ConfigError(f"{named('data_dir', local)} is not a directory; {fmt.how_to_get(name)}")
    return local if explicit or fmt.present(local) else None


def _damaged(e: Exception) -> bool:
    """Errors of reading a damaged prepared copy: its records (array_record/Riegeli) or its JSON metadata."""
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, (OSError, EOFError, ValueError)) or any(
        marker in text for marker in ("Riegeli", "ArrayRecord", "array_record", "ParseError", "DecodeError"))


def _tfds_progress(progress: bool | None) -> None:
    """TFDS's own progress bars (while it prepares a dataset) only where a run shows its bars: ``progress``
    None: only on a terminal (stderr), as the loop's. TFDS's switch is process-wide and has no getter: once off,
    it stays off."""
    if progress is False or (progress is None and not sys.stderr.isatty()):
        import tensorflow_datasets as tfds

        tfds.disable_progress_bar()


@console.shown
def load_split(name: str, split: str, *, data_dir=None, tfds_dir=None, progress: bool | None = None,
               **kwargs) -> Split:
    """The whole split in memory (47 MB for Fashion-MNIST train: cheap to keep).

    Decoding 60,000 TFDS records one by one takes seconds, so the arrays are
    also kept beside the prepared dataset (``SPLIT-arrays.npz``, with their
    sha256, checked on every read); a missing, damaged or unwritable copy
    just means reading the records again. A damaged conversion of local files
    is converted again (the files are the data); a damaged dataset TFDS
    prepared is a one-line error naming its directory. ``progress``: TFDS's progress bars while it prepares
    (None: only on a terminal).
    """
    if tfds_dir is not None and Path(tfds_dir).expanduser().exists() and not Path(tfds_dir).expanduser().is_dir():
        raise ConfigError(f"{named('tfds_dir', tfds_dir)} is not a directory: give the directory TFDS keeps its "
                          "prepared datasets in (made if missing)")
    _tfds_progress(progress)
    try:
        return _load_split(name, split, data_dir=data_dir, tfds_dir=tfds_dir, **kwargs)
    except Exception as e:
        if isinstance(e, ConfigError) or not _damaged(e):
            raise
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        local = None if name.startswith(TFDS_PREFIX) else _local_files(name, data_dir)
        if local is None or convert.process_index() > 0:
            import tensorflow_datasets as tfds

            where = Path(tfds_dir or tfds.core.constants.DATA_DIR).expanduser()
            raise ConfigError(f"the prepared copy of {name} in {where} cannot be read ({reason}): delete its "
                              f"directory there and prepare it again") from None
        where = convert.conversion_dir(LOCAL[name], name, local, tfds_dir)
        with convert.conversion_lock(where, local):
            log.warning(f"the converted copy of {local} in {where} is damaged ({reason}); converting again")
            shutil.rmtree(where, ignore_errors=True)
    return _load_split(name, split, data_dir=data_dir, tfds_dir=tfds_dir, **kwargs)


def _load_split(name: str, split: str, **kwargs) -> Split:
    source = data_source(name, split, **kwargs)
    cache = Path(source.dataset_info.data_dir) / f"jaxtrain-{split}-arrays.npz"
    try:
        with np.load(cache) as f:
            arrays = Split(f["images"], f["labels"], int(f["num_classes"]))
            if len(arrays) == len(source) and str(f["sha256"]) == split_digest(arrays):
                return arrays
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass
    arrays = _read_source(source)
    if convert.process_index() == 0:
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, images=arrays.images, labels=arrays.labels, num_classes=arrays.num_classes,
                         sha256=split_digest(arrays))
            os.replace(tmp, cache)
        except OSError:  # a read-only TFDS dir: fine, only slower next time
            tmp.unlink(missing_ok=True)
    return arrays
