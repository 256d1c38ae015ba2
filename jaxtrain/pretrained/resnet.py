"""torchvision's (and timm's: the same names) ResNet-18 / ResNet-50 ``state_dict`` names for jaxtrain's
``resnet18_imagenet`` / ``resnet50`` parameters and BatchNorm statistics, and each tensor's layout both ways.

    conv1 / bn1 / layer{S}.{i}.conv{1,2,3} / .bn{1,2,3} / .downsample.{0,1} / fc
    <->  conv (stem) / bn / blocks[k].conv{1,2,3} / .bn{1,2,3} / .shortcut / .bn_shortcut / dense

Convolution kernels are OIHW there, HWIO here; a dense kernel is (out, in) there, (in, out) here; BatchNorm's
weight / bias / running_mean / running_var are scale / bias / mean / var (the statistics in the model state).
Each BatchNorm's ``num_batches_tracked`` (a counter jaxtrain does not keep) is read as unused and written as 0.
"""

from __future__ import annotations

import numpy as np

BLOCKS = {"resnet18_imagenet": (2, 2, 2, 2), "resnet50": (3, 4, 6, 3)}
MODELS = tuple(BLOCKS)
NAMES = ("torchvision", "timm")  # the same names
_LEAVES = {"kernel": "weight", "scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}
_TOP = {"conv": "conv1", "stem": "conv1", "bn": "bn1", "dense": "fc"}
_BLOCK = {"shortcut": "downsample.0", "bn_shortcut": "downsample.1"}
COUNTER = "num_batches_tracked"


def name(model: str, path: tuple) -> str:
    """The source's name of jaxtrain's leaf at ``path`` (the keys into the params or model-state dict)."""
    *where, leaf = path
    if where[0] == "blocks":
        k, stage = where[1], 0
        while k >= BLOCKS[model][stage]:
            k, stage = k - BLOCKS[model][stage], stage + 1
        return f"layer{stage + 1}.{k}.{_BLOCK.get(where[2], where[2])}.{_LEAVES[leaf]}"
    return f"{_TOP[where[0]]}.{_LEAVES[leaf]}"


def is_head(path: tuple) -> bool:
    """The classifier: replaced, not loaded, when the class counts differ."""
    return path[0] == "dense"


def classes(source) -> int | None:
    return int(source["fc.weight"].shape[0]) if "fc.weight" in source else None


def read(model, path: tuple, source, like: tuple) -> tuple[np.ndarray, list[str], str]:
    """The registry Model ``model``'s leaf ``path`` from ``source``: (value, [its name], ""). A missing name:
    KeyError(name)."""
    n = name(model.name, path)
    if n not in source:
        raise KeyError(n)
    return to_ours(path, np.asarray(source[n])), [n], ""


def write(model: str, path: tuple, value: np.ndarray, names_: str) -> dict[str, np.ndarray]:
    return {name(model, path): to_source(path, value)}


def check_unused(model: str, unused: set[str]) -> None:
    """Nothing refused: a ResNet file's other tensors (its BatchNorms' counters) are named as unused."""


def to_ours(path: tuple, value: np.ndarray) -> np.ndarray:
    if path[-1] == "kernel":
        return value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T
    return value


def to_source(path: tuple, value: np.ndarray) -> np.ndarray:
    if path[-1] == "kernel":
        return value.transpose(3, 2, 0, 1) if value.ndim == 4 else value.T
    return value


def extras(names: list[str]) -> dict[str, np.ndarray]:
    """What the source keeps and jaxtrain does not: each BatchNorm's counter (0: torch's eval ignores it)."""
    return {n.rsplit(".", 1)[0] + "." + COUNTER: np.zeros((), np.int64) for n in names if n.endswith(".running_mean")}
