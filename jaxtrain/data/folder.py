"""A folder of images, one sub-folder per class (torchvision's ``ImageFolder`` layout, ImageNet's), indexed once.

    DIR/train/CLASS/*.jpg  and  DIR/val/CLASS/*  (or DIR/test/CLASS/*)
    DIR/CLASS/*            split by ``val_fraction`` (per class, a fixed seed)

Classes are the training folder's sub-folders, sorted by name. The index (each file's relative path, label,
and whether its header opens) is built once and kept in the index cache under a digest of every path, size
and modification time: a changed folder gets a new index, never an old one. Files whose header does not open
(not an image, zero bytes, larger than Pillow's pixel limit, a link that leads nowhere) are left out when the
index is built, counted, and said in one line; a file that fails later, while decoding, is the loader's to
handle (``FolderSplit.on_bad``). Nothing here decodes an image (``jaxtrain.data.images`` does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from jaxtrain import settings
from jaxtrain.io import console
from jaxtrain.data import jpeg
from jaxtrain.errors import ConfigError, named, need

JPEG_SUFFIXES = (".jpg", ".jpeg")
EXTENSIONS = (*JPEG_SUFFIXES, ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm")
EVAL_FOLDERS = ("val", "test")
ON_BAD = ("skip", "error")
log = logging.getLogger(__name__)
_ORDER_SEED = 20261127  # the fixed order files are kept in: ``head(n)`` is a random subset, not the first classes


@dataclasses.dataclass(frozen=True)
class FolderSplit:
    """One split of a folder: files (relative to ``root``), their labels, the classes; images come out
    ``size`` x ``size`` x 3 uint8 (``jaxtrain.data.images``); the loader sends them to the devices as uint8."""

    root: str
    files: tuple[str, ...]
    labels: np.ndarray
    class_names: tuple[str, ...]
    size: int
    on_bad: str = "skip"  # a file that fails to decode: "skip" (count, warn once per epoch) or "error"
    crop_fraction: float = 1.0  # evaluation: resize, then the centre ``crop_fraction`` of the shorter side
    index_digest: str = ""  # what it holds: its classes, files and sizes (not where it is, not their times)
    jpeg_library: str = ""  # the built JPEG region decoder its workers load ("": Pillow's decode; data.jpeg)
    raw = True  # uint8 batches: normalised on the device (the models' checked_images)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.size, self.size, 3)

    def head(self, n: int | None) -> "FolderSplit":
        """The first ``n`` files of the index's fixed random order (all for None): a subset of every class."""
        return self if n is None else dataclasses.replace(self, files=self.files[:n], labels=self.labels[:n])

    def examples(self, idx: np.ndarray, augment: str | None, seed: int, epoch: int) -> tuple[np.ndarray, list, list]:
        """(uint8 [len(idx), size, size, 3], [files that failed and were replaced], [JPEGs Pillow decoded: the region
        decoder refused them]): decoded and transformed in the calling process (a loader's worker); ``augment``: a
        training batch's (None: evaluation)."""
        from jaxtrain.data import images

        return images.read_batch(self, idx, augment=augment, seed=seed, epoch=epoch)

    def rows(self, idx: np.ndarray, *, train: bool, augment: str | None, seed: int,
             epoch: int) -> tuple[dict, list, list]:
        """({"image": uint8, "label"} of files ``idx``, failed files, JPEGs Pillow decoded) (``examples``)."""
        images, bad, pillow = self.examples(idx, augment if train else None, seed, epoch)
        return {"image": images, "label": self.labels[idx]}, bad, pillow


def digest(*splits: FolderSplit) -> str:
    """sha256 of what a run trains on: each split's files (by the folder's state), labels and classes."""
    h = hashlib.sha256()
    for split in splits:
        h.update(json.dumps([split.index_digest, split.class_names, split.files]).encode())
        h.update(np.ascontiguousarray(split.labels).tobytes())
    return h.hexdigest()


def check_dir(root: str | os.PathLike) -> Path:
    """``root`` as an absolute path, or a one-line ConfigError if it is not a readable directory."""
    path = Path(root).expanduser()
    if not path.is_dir():
        raise ConfigError(f"folder:{root}: not a directory (give DIR with DIR/train/CLASS/* and DIR/val/CLASS/*, "
                          f"or DIR/CLASS/* with {named('val_fraction')})")
    return path.resolve()


def _walk(root: Path) -> tuple[list[str], list[tuple[str, int, int]], list[str]]:
    """(class names, [(relative path, size, mtime ns)], [problems]) of ``root/CLASS/**``, links followed once."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    files, problems, seen = [], [], set()
    for name in classes:
        def unreadable(e: OSError) -> None:
            problems.append(f"{Path(e.filename).relative_to(root)} ({e.strerror}: not walked)")

        for top, dirs, names in os.walk(root / name, onerror=unreadable, followlinks=True):
            st = os.stat(top)
            if (st.st_dev, st.st_ino) in seen:  # a link back up the tree: walked once only
                problems.append(f"{Path(top).relative_to(root)} (a link loop)")
                dirs.clear()
                continue
            seen.add((st.st_dev, st.st_ino))
            dirs.sort()
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for n in sorted(names):
                if n.startswith(".") or not n.lower().endswith(EXTENSIONS):
                    continue
                path = Path(top) / n
                try:
                    st = path.stat()
                except OSError as e:  # a dangling link, a link loop
                    problems.append(f"{path.relative_to(root)} ({e.strerror or type(e).__name__})")
                    continue
                files.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    return classes, files, problems


def _opens(path: Path) -> str | None:
    """None if ``path``'s header opens as an image within Pillow's pixel limit; else why not."""
    from PIL import Image

    try:
        if path.stat().st_size == 0:
            return "zero bytes"
        with Image.open(path) as img:
            img.size  # noqa: B018 - the header is read by open
    except Image.DecompressionBombError as e:
        return f"too large: {str(e).split(', could be')[0]}"
    except (OSError, SyntaxError, ValueError) as e:
        return f"not an image ({type(e).__name__})"
    return None


def _index(root: Path, listing) -> dict:
    """Open each listed file's header; the index as JSON-able lists."""
    from tqdm.auto import tqdm

    good, bad = [], []
    bar = tqdm(listing, desc=f"indexing {root.name}", unit="file", disable=None, leave=False)
    for rel, _, _ in bar:
        why = _opens(root / rel)
        (good if why is None else bad).append(rel if why is None else f"{rel} ({why})")
    return {"files": good, "bad": bad}


def _cached_index(root: Path) -> tuple[list[str], dict]:
    """(classes, {"files": [...], "bad": [...], "problems": [...]}): from the index cache when the folder's
    digest matches, else built and kept (written atomically; an unwritable cache only means building again)."""
    classes, listing, problems = _walk(root)
    digest = hashlib.sha256(json.dumps([str(root), classes, listing]).encode()).hexdigest()
    cache = settings.current().index_cache / f"{digest[:32]}.json"
    try:
        index = json.loads(cache.read_text())
        if index.get("digest") == digest and "content" in index:
            return classes, index
    except FileNotFoundError:  # not indexed in this state yet
        pass
    except (OSError, ValueError) as e:
        log.warning(f"the index of {root} in {cache} cannot be read ({type(e).__name__}): indexing the folder again")
    content = hashlib.sha256(json.dumps([classes, [(rel, size) for rel, size, _ in listing]]).encode()).hexdigest()
    index = {"digest": digest, "content": content, "root": str(root), **_index(root, listing), "problems": problems}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, cache)
    except OSError as e:
        log.warning(f"the index of {root} cannot be kept in {cache.parent} ({e.strerror}): the next run indexes it "
                    "again (set JAXTRAIN_INDEX_CACHE to a writable directory)")
    return classes, index


def _say_left_out(where: Path, index: dict, warn) -> None:
    left_out = index["bad"] + index["problems"]
    if left_out:
        warn(f"{where}: {len(left_out)} file(s) left out of the index, e.g. {left_out[0]}"
             + (f" ({len(left_out) - 1} more)" if len(left_out) > 1 else ""))


def _labelled(root: Path, classes: list[str], index: dict, every_class: bool = True) -> tuple[list[str], np.ndarray]:
    """Each file with its class's number (its first path part's place among ``classes``); ``every_class``: a
    class with no usable image is a ConfigError."""
    number = {c: i for i, c in enumerate(classes)}
    files = [f for f in index["files"] if Path(f).parts[0] in number]
    labels = np.array([number[Path(f).parts[0]] for f in files], np.int32)
    empty = sorted(set(classes) - {Path(f).parts[0] for f in files})
    if empty and every_class:
        raise ConfigError(f"{root}: class folder(s) with no usable image: {', '.join(empty[:5])}"
                          + (f" (+{len(empty) - 5})" if len(empty) > 5 else "") + ": add images or remove them")
    return files, labels


@console.shown
def load(root: str | os.PathLike, size: int, *, val_fraction: float | None = None, on_bad: str = "skip",
         crop_fraction: float = 1.0, warn=log.warning) -> dict[str, FolderSplit]:
    """``{"train": FolderSplit, "test": FolderSplit}`` of the folder ``root`` (layouts above); ``warn``: how the
    files left out of the index are said (one line per split; a run: by its first process only)."""
    if on_bad not in ON_BAD:
        raise ConfigError(f"{named('on_bad_image', repr(on_bad))}: use one of {', '.join(ON_BAD)}")
    need("PIL.Image", f"image folders ({named('dataset', 'folder:PATH')})")
    if not 1 <= size <= 4096:
        raise ConfigError(f"{named('image_size', size)}: give a side length in pixels, 1 to 4096")
    base = check_dir(root)
    train_dir, test_dir = base / "train", next((base / d for d in EVAL_FOLDERS if (base / d).is_dir()), None)

    def make(where: Path, index: dict, files: list[str], labels: np.ndarray, classes) -> FolderSplit:
        order = np.random.default_rng(_ORDER_SEED).permutation(len(files))
        if not files:
            raise ConfigError(f"{where}: no usable image in it: add images")
        library = ""
        if settings.current().jpeg_decoder == "region" and any(f.lower().endswith(JPEG_SUFFIXES) for f in files):
            library = jpeg.check()  # built here, before any worker starts; where it cannot be, one line says so
        return FolderSplit(str(where), tuple(files[i] for i in order), labels[order], tuple(classes), size,
                           on_bad, crop_fraction, index["content"], library)

    if train_dir.is_dir():
        if test_dir is None:
            raise ConfigError(f"{base} has train/ but no val/ or test/ beside it: add one (one sub-folder per class)")
        if val_fraction is not None:
            raise ConfigError(f"{base} has train/ and {test_dir.name}/: {named('val_fraction')} is for a folder "
                              "with one sub-folder per class and no split")
        classes, index = _cached_index(train_dir)
        if not classes:
            raise ConfigError(f"{train_dir} has no class folders: put each class's images in train/CLASS/")
        test_classes, test_index = _cached_index(test_dir)
        if extra := sorted(set(test_classes) - set(classes)):
            raise ConfigError(f"{test_dir} has classes train/ lacks: {', '.join(extra[:5])}: remove them or add "
                              "them to train/")
        _say_left_out(train_dir, index, warn)
        _say_left_out(test_dir, test_index, warn)
        present = {Path(f).parts[0] for f in test_index["files"]}
        if missing := [c for c in classes if c not in present]:
            warn(f"{test_dir} has no images of {len(missing)} of train/'s {len(classes)} classes "
                 f"({', '.join(missing[:5])}{' ...' * (len(missing) > 5)}): the evaluation covers the others only")
        return {"train": make(train_dir, index, *_labelled(train_dir, classes, index), classes),
                "test": make(test_dir, test_index, *_labelled(test_dir, classes, test_index, False), classes)}
    if test_dir is not None and val_fraction is None:  # with val_fraction: a class of that name (two at least)
        raise ConfigError(f"{base} has {test_dir.name}/ but no train/ beside it: add train/ (one sub-folder per "
                          f"class)")
    classes, index = _cached_index(base)
    if not classes:
        raise ConfigError(f"folder:{root} has no class folders: give DIR/CLASS/*.jpg (with {named('val_fraction')}) or "
                          "DIR/train/CLASS/* and DIR/val/CLASS/*")
    if val_fraction is None:
        raise ConfigError(f"{base} has no train/ and val/ folders: pass {named('val_fraction')} (e.g. 0.1) to hold "
                          "out a share of each class for evaluation")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"{named('val_fraction', val_fraction)}: give a share between 0 and 1 (e.g. 0.1)")
    _say_left_out(base, index, warn)
    files, labels = _labelled(base, classes, index)
    rng, held = np.random.default_rng(_ORDER_SEED), np.zeros(len(files), bool)
    for c in range(len(classes)):  # each class's share, so a small class is held out too
        members = np.flatnonzero(labels == c)
        held[rng.permutation(members)[:round(val_fraction * len(members))]] = True
    if held.all():
        raise ConfigError(f"{named('val_fraction', val_fraction)} holds out every image of {base}, leaving none to "
                          f"train on: lower {named('val_fraction')} (e.g. 0.1), or add images")
    if not held.any():
        raise ConfigError(f"{named('val_fraction', val_fraction)} holds out no image of {base} (each class's share "
                          f"rounds to 0): raise {named('val_fraction')}, or add images")
    return {name: make(base, index, [files[i] for i in pick], labels[pick], classes)
            for name, pick in (("train", np.flatnonzero(~held)), ("test", np.flatnonzero(held)))}
