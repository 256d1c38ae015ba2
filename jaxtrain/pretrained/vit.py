"""timm's and Hugging Face's ViT ``state_dict`` names for jaxtrain's ``vit_tiny`` / ``vit_small`` / ``vit_base``
parameters, and each tensor's layout both ways.

    timm:  cls_token, pos_embed, patch_embed.proj, blocks.{i}.norm1 / .attn.qkv / .attn.proj / .norm2 / .mlp.fc1 /
           .mlp.fc2, norm, head
    HF:    [vit.]embeddings.cls_token / .position_embeddings / .patch_embeddings.projection,
           [vit.]layers.{i}.layernorm_before / .attention.{q,k,v,o}_proj / .layernorm_after / .mlp.fc1 / .mlp.fc2
           (transformers 5), or [vit.]encoder.layer.{i}.layernorm_before / .attention.attention.{query,key,value} /
           .attention.output.dense / .layernorm_after / .intermediate.dense / .output.dense (transformers 4, the
           Hub's files), [vit.]layernorm, classifier (``ViTForImageClassification``; ``ViTModel`` has no prefix,
           no classifier, and a pooler)

jaxtrain stacks the blocks (``stages`` leaves ``[depth, ...]``) and keeps q, k and v in one ``qkv`` matrix
(``[dim, 3 dim]``: timm's ``qkv`` transposed; Hugging Face's three concatenated). The patch embedding's
convolution kernel (OIHW there) is a matrix over (row, column, channel) patches here. A position embedding for
another grid of patches (another image size) is resampled as timm does (bicubic, antialiased, the class token's
kept): ``resample``. The file's Vision Transformer must be this one: a tensor of a variant jaxtrain's does not
compute (layer scale, register tokens, a norm after pooling, q/k norms) is a one-line error, not left unused.
"""

from __future__ import annotations

import math
import re

import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.pretrained import tensors

MODELS = ("vit_tiny", "vit_small", "vit_base")
_TIMM = {"ln1": "norm1.weight", "ln1_b": "norm1.bias", "qkv": "attn.qkv.weight", "qkv_b": "attn.qkv.bias",
         "proj": "attn.proj.weight", "proj_b": "attn.proj.bias", "ln2": "norm2.weight", "ln2_b": "norm2.bias",
         "mlp1": "mlp.fc1.weight", "mlp1_b": "mlp.fc1.bias", "mlp2": "mlp.fc2.weight", "mlp2_b": "mlp.fc2.bias"}
_HF4 = {"ln1": "layernorm_before.weight", "ln1_b": "layernorm_before.bias", "proj": "attention.output.dense.weight",
        "proj_b": "attention.output.dense.bias", "ln2": "layernorm_after.weight", "ln2_b": "layernorm_after.bias",
        "mlp1": "intermediate.dense.weight", "mlp1_b": "intermediate.dense.bias", "mlp2": "output.dense.weight",
        "mlp2_b": "output.dense.bias"}  # transformers 4's (the Hub's files): encoder.layer.{i}.
_HF = {**_HF4, "proj": "attention.o_proj.weight", "proj_b": "attention.o_proj.bias", "mlp1": "mlp.fc1.weight",
       "mlp1_b": "mlp.fc1.bias", "mlp2": "mlp.fc2.weight", "mlp2_b": "mlp.fc2.bias"}  # transformers 5's: layers.{i}.
_QKV = {"hf": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
        "hf4": ("attention.attention.query", "attention.attention.key", "attention.attention.value")}
_TOP = {"timm": {("embed", "patch"): "patch_embed.proj.weight", ("embed", "bias"): "patch_embed.proj.bias",
                 ("embed", "pos"): "pos_embed", ("embed", "cls"): "cls_token", ("head", "ln"): "norm.weight",
                 ("head", "ln_b"): "norm.bias", ("head", "w"): "head.weight", ("head", "b"): "head.bias"},
        "hf": {("embed", "patch"): "embeddings.patch_embeddings.projection.weight",
               ("embed", "bias"): "embeddings.patch_embeddings.projection.bias",
               ("embed", "pos"): "embeddings.position_embeddings", ("embed", "cls"): "embeddings.cls_token",
               ("head", "ln"): "layernorm.weight", ("head", "ln_b"): "layernorm.bias"}}
_HF_HEAD = {("head", "w"): "classifier.weight", ("head", "b"): "classifier.bias"}  # never under the "vit." prefix
UNUSED_OK = re.compile(r"(vit\.)?pooler\.dense\.(weight|bias)$")  # ViTModel's pooler: not what a classifier uses
NAMES = ("timm", "hf", "hf4")


def config(model: str):
    """The ``jaxtrain.models.vit.Config`` of the registry ``model``."""
    from jaxtrain import models
    from jaxtrain.models import vit

    return getattr(vit, models.VIT_CONFIGS[model])


def scheme(source) -> tuple[str, str]:
    """(``"timm"`` | ``"hf"`` (transformers 5's names) | ``"hf4"`` (transformers 4's), the HF prefix) of a state
    dict's names."""
    if "patch_embed.proj.weight" in source:
        return "timm", ""
    for prefix in ("vit.", ""):
        if f"{prefix}embeddings.patch_embeddings.projection.weight" in source:
            return ("hf4" if any(n.startswith(f"{prefix}encoder.layer.") for n in source) else "hf"), prefix
    raise ConfigError("no ViT patch embedding (timm's patch_embed.proj.weight, Hugging Face's "
                      "[vit.]embeddings.patch_embeddings.projection.weight): is it a timm or Hugging Face ViT file?")


def names(path: tuple, names_: str = "timm", prefix: str = "", depth: int = 1) -> list[str]:
    """The source's names of jaxtrain's leaf at ``path`` (a stacked leaf: one per block; HF's qkv: q, k, v)."""
    if path[0] == "stages":
        leaf = path[1]
        if names_ == "timm":
            return [f"blocks.{i}.{_TIMM[leaf]}" for i in range(depth)]
        layer = f"{prefix}{'encoder.layer' if names_ == 'hf4' else 'layers'}"
        if leaf in ("qkv", "qkv_b"):
            end = "weight" if leaf == "qkv" else "bias"
            return [f"{layer}.{i}.{part}.{end}" for i in range(depth) for part in _QKV[names_]]
        return [f"{layer}.{i}.{(_HF4 if names_ == 'hf4' else _HF)[leaf]}" for i in range(depth)]
    if names_ != "timm" and path in _HF_HEAD:
        return [_HF_HEAD[path]]
    return [("" if names_ == "timm" else prefix) + _TOP["timm" if names_ == "timm" else "hf"][path]]


def is_head(path: tuple) -> bool:
    """The classifier: the model's own fresh one when the class counts differ (or the file has none)."""
    return path in (("head", "w"), ("head", "b"))


def classes(source) -> int | None:
    for name in ("head.weight", "classifier.weight"):
        if name in source:
            return int(source[name].shape[0])
    return None


def _one(path: tuple, value: np.ndarray) -> np.ndarray:
    """One source tensor in jaxtrain's layout."""
    if path == ("embed", "patch"):  # OIHW -> (H, W, I) x O
        return value.transpose(2, 3, 1, 0).reshape(-1, value.shape[0])
    if path == ("embed", "pos"):
        return value.reshape(-1, value.shape[-1])
    if path == ("embed", "cls"):
        return value.reshape(-1)
    return value.T if value.ndim == 2 else value


def read(model, path: tuple, source, like: tuple) -> tuple[np.ndarray, list[str], str]:
    """The registry Model ``model``'s leaf ``path`` (shaped ``like``) from ``source``: (value, the names used, a
    note of what was resampled or ""). A missing name: KeyError(name); a block's tensor of another shape:
    ``tensors.Mismatch``."""
    names_, prefix = scheme(source)
    depth = like[0] if path[0] == "stages" else 1
    used = names(path, names_, prefix, depth)
    for name in used:
        if name not in source:
            raise KeyError(name)
    parts = []
    for n in used:
        try:
            parts.append(_one(path, np.asarray(source[n])))
        except ValueError:  # a tensor of another rank than this leaf's (a transpose or reshape that cannot be)
            raise ConfigError(f"{n} is {'x'.join(map(str, np.shape(source[n])))}: not the ViT tensor "
                              f"{model.name}'s {'/'.join(path)} is made from") from None
    if path[0] == "stages":  # one block's tensor of another shape: named (the stack would not say which)
        want = (*like[1:-1], like[-1] * depth // len(parts))
        for n, part in zip(used, parts):
            if part.shape != want:
                raise tensors.Mismatch(n, want[::-1])  # in the source's layout (a matrix transposed)
    if path[0] != "stages":
        value = parts[0]
    elif len(parts) > depth:  # HF's q, k and v of each block side by side
        value = np.stack([np.concatenate(parts[3 * i:3 * i + 3], axis=-1) for i in range(depth)])
    else:
        value = np.stack(parts)
    if path == ("embed", "pos"):
        h, w, _ = model.input_shape
        patch = config(model.name).patch
        return _resampled(value, (h // patch, w // patch), used[0])
    return value, used, ""


def _resampled(value: np.ndarray, grid: tuple[int, int], name: str) -> tuple[np.ndarray, list[str], str]:
    """The position embedding (class token's first) for the model's ``grid`` of patches (rows, columns): the
    file's square grid resampled when it is another one, as timm's ``resample_abs_pos_embed`` does."""
    old = value.shape[0] - 1
    side = math.isqrt(old)
    if side * side != old:
        raise ConfigError(f"{name} holds {old} patch positions, not a square grid: a ViT of another kind?")
    if (side, side) == grid:
        return value, [name], ""
    rows, cols = grid
    embedded = value[1:].reshape(side, side, -1).astype(np.float64)
    embedded = np.einsum("ij,jkc->ikc", resample_matrix(side, rows), embedded)
    embedded = np.einsum("ij,kjc->kic", resample_matrix(side, cols), embedded)
    out = np.concatenate([value[:1], embedded.reshape(rows * cols, -1).astype(value.dtype)])
    return out, [name], f"resampled {name} ({side}x{side} -> {rows}x{cols} patches)"


def resample_matrix(size: int, new_size: int) -> np.ndarray:
    """``[new_size, size]``: PyTorch's antialiased bicubic resize along one axis (``F.interpolate(mode="bicubic",
    antialias=True, align_corners=False)``, what timm's ``resample_abs_pos_embed`` calls): Keys' cubic with
    a = -0.5, stretched by the scale when shrinking, each row's weights normalised."""

    def cubic(x: float, a: float = -0.5) -> float:
        x = abs(x)
        if x < 1:
            return ((a + 2) * x - (a + 3)) * x * x + 1
        return (((x - 5) * x + 8) * x - 4) * a if x < 2 else 0.0

    scale = size / new_size
    support, inv = (2 * scale, 1 / scale) if scale >= 1 else (2.0, 1.0)
    m = np.zeros((new_size, size), np.float64)
    for i in range(new_size):
        center = scale * (i + 0.5)
        lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), size)
        w = np.array([cubic((j - center + 0.5) * inv) for j in range(lo, hi)])
        m[i, lo:hi] = w / w.sum()
    return m


def write(model: str, path: tuple, value: np.ndarray, names_: str) -> dict[str, np.ndarray]:
    """jaxtrain's leaf ``path`` of ``model`` as the source's tensors (``names_``: ``"timm"``, or a
    ``ViTForImageClassification``'s: ``"hf"`` in transformers 5's names, ``"hf4"`` in 4's, as the Hub's files)."""
    depth = value.shape[0] if path[0] == "stages" else 1
    out_names = names(path, names_, "vit.", depth)
    if path == ("embed", "patch"):
        patch = config(model).patch
        channels = value.shape[0] // (patch * patch)
        return {out_names[0]: value.reshape(patch, patch, channels, -1).transpose(3, 2, 0, 1)}
    if path == ("embed", "pos"):
        return {out_names[0]: value[None]}
    if path == ("embed", "cls"):
        return {out_names[0]: value[None, None]}
    if path[0] != "stages":
        return {out_names[0]: value.T if value.ndim == 2 else value}
    pieces = len(out_names) // depth
    out = {}
    for i in range(depth):
        for k, part in enumerate(np.split(value[i], pieces, axis=-1)):
            out[out_names[i * pieces + k]] = part.T if part.ndim == 2 else part
    return out


def extras(names_: list[str]) -> dict[str, np.ndarray]:
    """Nothing: a ViT keeps no counters."""
    return {}


def check_unused(model: str, unused: set[str]) -> None:
    """A tensor this ViT does not compute with is another variant's: refused (its output would differ)."""
    depth = config(model).depth
    strange = sorted(n for n in unused if not UNUSED_OK.match(n))
    blocks = {int(m[2]) for n in strange if (m := re.match(r"(.*blocks|.*encoder\.layer|.*layers)\.(\d+)\.", n))}
    if blocks and max(blocks) >= depth:
        raise ConfigError(f"the file's ViT has {max(blocks) + 1} blocks, {model} {depth}: another size?")
    if strange:
        raise ConfigError(f"the file's ViT has {', '.join(strange[:3])}{' ...' if len(strange) > 3 else ''}, which "
                          f"{model} does not compute (another variant: layer scale, register tokens, q/k norms?)")
