"""Map a file's tensors onto a registry model and back: ``load`` (-> ``Loaded``), ``export``, ``save``
(the package's face, ``jaxtrain.pretrained``, says how to use them)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np

from jaxtrain.core.state import Frozen, is_frozen
from jaxtrain.errors import ConfigError
from jaxtrain.pretrained import resnet, tensors, vit

ARCHITECTURES = {name: arch for arch in (resnet, vit) for name in arch.MODELS}  # registry model -> names, layouts


@dataclasses.dataclass(frozen=True)
class Loaded:
    """What ``load`` made: the model's (params, model_state), and what the file held that was not used
    (``unused``: names), was left for the model's own (``replaced``: "name (shape there -> here)"), was
    resampled to the model's shape (``resampled``: a ViT's position embedding for another image size) or was
    converted to the model's dtype (``converted``: "float16 -> float32 (62 tensors)")."""

    params: dict
    model_state: dict
    unused: tuple[str, ...]
    replaced: tuple[str, ...]
    resampled: tuple[str, ...] = ()
    converted: tuple[str, ...] = ()

    @property
    def variables(self) -> tuple[dict, dict]:
        return self.params, self.model_state

    def summary(self, source: str) -> str:
        """One line: what was loaded, converted, resampled, replaced and left unused."""
        kinds = {n: n.rsplit(".", 1)[-1] for n in self.unused}
        counts = Counter(kinds.values())  # a repeated kind (BatchNorm's counters) once, a lone tensor in full
        unused = ", ".join(sorted({f"{k} x{counts[k]}" if counts[k] > 1 else n for n, k in kinds.items()}))
        return (f"{source}: loaded" + (f"; converted {', '.join(self.converted)}" if self.converted else "")
                + "".join(f"; {r}" for r in self.resampled)
                + (f"; replaced {', '.join(self.replaced)}" if self.replaced else "")
                + (f"; unused: {unused}" if unused else ""))


def _architecture(model: str):
    if model not in ARCHITECTURES:
        hint = ": torchvision's ResNet-18 is resnet18_imagenet (resnet18 is d2l's)" if model == "resnet18" else ""
        hint = hint or (": timm's ViT-Tiny/16 is vit_tiny (vit is jaxtrain's small one)" if model == "vit" else "")
        raise ConfigError(f"model {model}: pretrained weights are read and written for {', '.join(ARCHITECTURES)} "
                          f"(torchvision's and timm's ResNets, timm's and Hugging Face's ViTs){hint}")
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


def _shape(a) -> str:
    """A tensor's (or a shape's) dimensions as 3x4x5."""
    return "x".join(map(str, getattr(a, "shape", a)))


def _mismatch(path, source, model: str, name: str, needed: tuple) -> ConfigError:
    return ConfigError(f"{path}: {name} is {_shape(source[name])}, {model} needs {_shape(needed)} there: another "
                       "network?")


def load(path: str | Path, into, *, num_classes: int | None = None, input_shape: tuple | None = None,
         seed: int = 0) -> Loaded:
    """``path``'s weights in the registry model ``into`` (a name, or a ``jaxtrain.models.Model``; by name,
    made for ``input_shape`` (default 224x224x3) and ``num_classes`` (default: the file's)); a classifier of
    another class count, or none in the file, is the model's fresh one (``seed``). A GPT (a ``LanguageModel``)
    takes a GPT-2 file of its own shape whole (``jaxtrain.pretrained.gpt2``)."""
    import jax

    from jaxtrain import models

    if isinstance(into, models.LanguageModel):  # GPT-2's files: read whole (jaxtrain.pretrained.gpt2)
        from jaxtrain.pretrained import gpt2

        return Loaded(gpt2.load(path, into.config), {}, (), ())
    stored = tensors.read(path, stored=True)
    source = tensors.as_float32(stored)
    arch = _architecture(into if isinstance(into, str) else into.name)
    if isinstance(into, str):
        classes = num_classes or arch.classes(source) or 1000
        into = models.get(into, input_shape=tuple(input_shape or (224, 224, 3)), num_classes=classes, conv="xla")
    params, state = jax.tree.map(np.asarray, into.init(jax.random.key(seed)))
    frozen = is_frozen(state)  # a linear probe carries its model state Frozen: the file fills the tree inside
    state = state.tree if frozen else state
    used, replaced, resampled, converted = set(), [], [], Counter()
    for tree in (params, state):
        for where, mine in list(_leaves(tree)):
            try:
                theirs, names, note = arch.read(into, where, source, mine.shape)
            except tensors.Mismatch as e:
                raise _mismatch(path, source, into.name, *e.args) from None
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None
            except KeyError as e:
                if arch.is_head(where):
                    replaced.append(f"{e.args[0]} (none there)")
                    continue
                raise ConfigError(f"{path}: no tensor {e.args[0]} (for {into.name}'s {'/'.join(map(str, where))}): "
                                  f"is it a {' or '.join(arch.NAMES)} {into.name.split('_')[0]} file?") from None
            used.update(names)
            for n in names:
                if not tensors.is_float(stored[n].dtype):
                    raise ConfigError(f"{path}: {n} is {stored[n].dtype}, {into.name} needs floating-point numbers "
                                      "there: a quantized or cast file? give its float weights (float32, float16 "
                                      "or bfloat16)")
                if stored[n].dtype != mine.dtype:
                    converted[f"{stored[n].dtype} -> {mine.dtype}"] += 1
            resampled += [note] if note else []
            if theirs.shape != mine.shape:
                needed = next(iter(arch.write(into.name, where, mine, arch.NAMES[0]).values())).shape  # its one
                if not arch.is_head(where):
                    raise _mismatch(path, source, into.name, names[0], needed)
                replaced.append(f"{names[0]} ({_shape(source[names[0]])} -> {_shape(needed)})")
                continue
            _set(tree, where, theirs.astype(mine.dtype))
    unused = set(source) - used
    arch.check_unused(into.name, unused)
    return Loaded(params, Frozen(state) if frozen else state, tuple(sorted(unused)), tuple(replaced),
                  tuple(resampled), tuple(f"{k} ({n} tensor{'s' * (n != 1)})" for k, n in sorted(converted.items())))


def export(model: str, params: dict, model_state: dict, names: str | None = None) -> dict[str, np.ndarray]:
    """The source library's ``state_dict`` of jaxtrain's ``params`` / ``model_state`` of the registry ``model`` in
    numpy and its layouts; ``names``: whose (``"torchvision"`` or ``"timm"`` for the ResNets, the same;
    ``"timm"`` (default) or ``"hf"`` for the ViTs)."""
    arch = _architecture(model)
    names = names or arch.NAMES[0]
    if names not in arch.NAMES:
        raise ConfigError(f"{model} is written in {' or '.join(arch.NAMES)}'s names, not {names!r}")
    out = {}
    for tree in (params, model_state):
        for where, value in _leaves(tree):
            out.update(arch.write(model, where, np.asarray(value, np.float32), names))
    return {**out, **arch.extras(list(out))}


def save(model: str, variables: tuple[dict, dict], path: str | Path, names: str | None = None) -> Path:
    """jaxtrain's ``variables`` (params, model_state) of the registry ``model`` as ``path``: ``.safetensors`` or
    PyTorch's ``.pth``, in the names and layouts the source library's models load (``load_state_dict``):
    torchvision's and timm's ResNets, timm's ViTs (``names="hf"``: Hugging Face's ``ViTForImageClassification``).
    A finished run's: ``jaxtrain.driver.export.save_pretrained(run_dir, path)``."""
    return tensors.write(export(model, *variables, names=names), path)
