"""A dataset cut down to some of its classes (``--classes``): their examples only, relabelled 0..k-1 in the order
given, so a model trains on a class subset of a folder or of CIFAR-10 as on a dataset of its own."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtrain.errors import ConfigError, named

# The local datasets' class names, in label order (a folder's are its sub-folders).
NAMES = {
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
    "fashion_mnist": ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                      "ankle-boot"),
    "mnist": tuple("0123456789"),
}


def names_of(dataset: str, split) -> tuple[str, ...]:
    """The split's class names: a folder's, a local dataset's, else the label numbers."""
    return getattr(split, "class_names", None) or NAMES.get(dataset) or tuple(map(str, range(split.num_classes)))


def pick(spec: str, names: tuple[str, ...]) -> list[int]:
    """The labels ``spec`` names ("cat,dog" or "3,5": names, or label numbers), in its order; a one-line
    ConfigError for an unknown or repeated one, or fewer than two. Where a class's name is a number (a folder
    "2012/", MNIST's "7"), a number is a name only: label 2 is never taken for a folder "2" that is not there."""
    numbered = any(n.isdigit() for n in names)
    keep = []
    for item in (s.strip() for s in spec.split(",")):
        label = names.index(item) if item in names else int(item) if item.isdigit() and not numbered else -1
        if not 0 <= label < len(names):
            raise ConfigError(f"{named('classes', repr(spec))}: {item!r} is not a class of this dataset (its classes: "
                              f"{', '.join(names[:12])}{', ...' if len(names) > 12 else ''}; "
                              f"{'its names are numbers, so name them' if numbered else 'or give label numbers'})")
        if label in keep:
            raise ConfigError(f"{named('classes', repr(spec))}: {item!r} is named twice")
        keep.append(label)
    if len(keep) < 2:
        raise ConfigError(f"{named('classes', repr(spec))}: name at least two classes to train a classifier on")
    return keep


def select(split, keep: list[int], names: tuple[str, ...]):
    """``split`` with only the examples of labels ``keep``, label ``keep[i]`` becoming ``i``."""
    from jaxtrain.data.folder import FolderSplit
    from jaxtrain.data.split import Split

    labels = np.asarray(split.labels)
    remap = np.full(max(len(names), int(labels.max(initial=0)) + 1), -1, np.int32)
    remap[keep] = np.arange(len(keep), dtype=np.int32)
    mask = remap[labels] >= 0
    if isinstance(split, FolderSplit):
        return dataclasses.replace(split, files=tuple(f for f, m in zip(split.files, mask) if m),
                                   labels=remap[labels[mask]], class_names=tuple(names[k] for k in keep))
    if isinstance(split, Split):
        return dataclasses.replace(split, images=split.images[mask], labels=remap[labels[mask]], num_classes=len(keep))
    raise ConfigError(f"{named('classes')}: works on image folders and the local datasets ({', '.join(NAMES)}), not on "
                      f"{type(split).__name__}")


def restricted(dataset: str, data: dict, spec: str | None) -> dict:
    """Every split of ``data`` cut to the classes ``spec`` names (all of them for None)."""
    if not spec:
        return data
    names = names_of(dataset, data["train"])
    keep = pick(spec, names)
    cut = {k: select(v, keep, names) for k, v in data.items()}
    for k, split in cut.items():
        if not len(split):
            raise ConfigError(f"{named('classes', repr(spec))}: the {'test' if k == 'test' else 'training'} split "
                              f"holds no example of them: name classes it holds")
    return cut
