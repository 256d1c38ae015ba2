"""Weights from other libraries, and back: ``load(path, into=MODEL)`` and ``save(MODEL, variables, path)``.

    from jaxtrain import pretrained
    params, model_state = pretrained.load("resnet50.pth", into="resnet50", num_classes=10).variables
    pretrained.save("resnet50", (params, model_state), "mine.safetensors")  # torchvision / timm load it back

A local file the user supplies (``jaxtrain.pretrained.tensors``: safetensors, or PyTorch's ``state_dict``),
mapped onto a registry model (``resnet18_imagenet``, ``resnet50``: torchvision's and timm's ResNets). Every
tensor of the file is used or named as unused (one line); a tensor the model needs that the file lacks, or
whose shape differs, is a one-line error naming it, except the classifier: with another class count it is
the model's own fresh one (said as replaced).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.pretrained import resnet, tensors

ARCHITECTURES = {name: resnet for name in resnet.BLOCKS}  # registry model -> its names and layouts


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What ``load`` made: the model's (params, model_state), and what the file held that was not used
    (``unused``: names) or was left for the model's own (``replaced``: "name (shape there -> here)")."""

    params: dict
    model_state: dict
    unused: tuple[str, ...]
    replaced: tuple[str, ...]

    @property
    def variables(self) -> tuple[dict, dict]:
        return self.params, self.model_state

    def summary(self, source: str) -> str:
        """One line: what was loaded, replaced and left unused."""
        counts = Counter(n.rsplit(".", 1)[-1] for n in self.unused)
        unused = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(counts.items()))
        return (f"{source}: loaded" + (f"; replaced {', '.join(self.replaced)}" if self.replaced else "")
                + (f"; unused: {unused}" if unused else ""))


def _architecture(model: str):
    if model not in ARCHITECTURES:
        hint = ": torchvision's ResNet-18 is resnet18_imagenet (resnet18 is d2l's)" if model == "resnet18" else ""
        raise ConfigError(f"model {model}: pretrained weights load into {', '.join(ARCHITECTURES)} (torchvision's "
                          f"and timm's ResNets){hint}")
    return ARCHITECTURES[model]


def _leaves(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load(path: str | Path, into, *, num_classes: int | None = None, input_shape: tuple | None = None,
         seed: int = 0) -> Loaded:
    """``path``'s weights in the registry model ``into`` (a name, or a ``jaxtrain.models.Model``; by name,
    made for ``input_shape`` (default 224x224x3) and ``num_classes`` (default: the file's)); a classifier of
    another class count is the model's fresh one (``seed``)."""
    import jax

    from jaxtrain import models

    source = tensors.read(path)
    if isinstance(into, str):
        arch = _architecture(into)
        classes = num_classes or int(source.get("fc.weight", np.zeros((1000, 1))).shape[0])
        into = models.get(into, input_shape=tuple(input_shape or (224, 224, 3)), num_classes=classes, conv="xla")
    else:
        arch = _architecture(into.name)
    params, state = jax.tree.map(np.asarray, into.init(jax.random.key(seed)))
    used, replaced = set(), []
    for tree in (params, state):
        for where, mine in list(_leaves(tree)):
            name = arch.name(into.name, where)
            if name not in source:
                raise ConfigError(f"{path}: no tensor {name} (for {into.name}'s {'/'.join(map(str, where))}): is it "
                                  f"a torchvision or timm {into.name.split('_')[0]} file?")
            used.add(name)
            theirs = arch.to_ours(where, source[name])
            if theirs.shape != mine.shape:
                if arch.is_head(where):
                    replaced.append(f"{name} ({'x'.join(map(str, source[name].shape))} -> "
                                    f"{'x'.join(map(str, arch.to_source(where, mine).shape))})")
                    continue
                raise ConfigError(f"{path}: {name} is {'x'.join(map(str, source[name].shape))}, {into.name} needs "
                                  f"{'x'.join(map(str, arch.to_source(where, mine).shape))} there: another network?")
            _set(tree, where, theirs.astype(mine.dtype))
    return Loaded(params, state, tuple(sorted(set(source) - used)), tuple(replaced))


def export(model: str, params: dict, model_state: dict) -> dict[str, np.ndarray]:
    """The source library's ``state_dict`` of jaxtrain's ``params`` / ``model_state`` (numpy, its layouts)."""
    arch = _architecture(model)
    out = {arch.name(model, where): arch.to_source(where, np.asarray(value, np.float32))
           for tree in (params, model_state) for where, value in _leaves(tree)}
    return {**out, **arch.extras(list(out))}


def save(model: str, variables: tuple[dict, dict], path: str | Path) -> Path:
    """jaxtrain's ``variables`` (params, model_state) of the registry ``model`` as ``path``: ``.safetensors`` or
    PyTorch's ``.pth``, in the names and layouts torchvision's and timm's models load (``load_state_dict``).
    A finished run's: ``jaxtrain.driver.export.save_pretrained(run_dir, path)``."""
    return tensors.write(export(model, *variables), path)
