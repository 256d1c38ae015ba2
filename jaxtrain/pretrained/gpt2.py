"""Hugging Face's GPT-2 files in jaxtrain's GPT layout (``jaxtrain.models.gpt``), and back.

    transformer.wte / .wpe, transformer.h.{i}.ln_1 / .attn.c_attn / .attn.c_proj / .ln_2 / .mlp.c_fc /
    .mlp.c_proj, transformer.ln_f; lm_head (tied to wte)         (``GPT2LMHeadModel``; ``GPT2Model``: no prefix)

GPT-2's ``Conv1D`` holds its matrices ``[in, out]``, as jaxtrain does; jaxtrain stacks the blocks (``stages``
leaves ``[L, ...]``), splits the fused query, key and value by head (``[D, 3, H, D/H]``: the same numbers,
reshaped) and pads the token embedding to ``Config.padded_vocab`` rows (zeros: their logits are cut). A file
is read as a whole: a tensor the GPT needs that it lacks, or of another shape, is a one-line error naming it,
and so is a tensor it holds that this GPT does not compute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxtrain.errors import ConfigError, named
from jaxtrain.pretrained import tensors

_BLOCK = {"ln1": "ln_1.weight", "ln1_b": "ln_1.bias", "qkv": "attn.c_attn.weight", "qkv_b": "attn.c_attn.bias",
          "proj": "attn.c_proj.weight", "proj_b": "attn.c_proj.bias", "ln2": "ln_2.weight", "ln2_b": "ln_2.bias",
          "fc": "mlp.c_fc.weight", "fc_b": "mlp.c_fc.bias", "out": "mlp.c_proj.weight", "out_b": "mlp.c_proj.bias"}
_BUFFERS = ("attn.bias", "attn.masked_bias")  # older transformers' causal masks: not weights
PREFIX = "transformer."


def load(path: str | Path, config) -> dict:
    """The GPT's params (``jaxtrain.models.gpt``'s layout, float32) from a GPT-2 file (safetensors, or PyTorch's
    ``state_dict``) of the shape ``config`` (a ``gpt.Config``) says; the file's position embedding may hold more
    positions than ``config.seq_len`` (the first are kept)."""
    learned_positions(config, f"{path}: a Hugging Face GPT-2 file")
    by_name = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in tensors.read(path).items()}
    L, D, H, F = config.layers, config.width, config.heads, config.mlp_ratio * config.width
    used = set()

    def take(name: str, shape: tuple) -> np.ndarray:
        if name not in by_name:
            raise ConfigError(f"{path}: no tensor {name} (is it a GPT-2 file of {L} layers?)")
        value = by_name[name]
        if value.shape != shape:
            raise ConfigError(f"{path}: {name} is {list(value.shape)}, this GPT needs {list(shape)} (its vocab, "
                              f"seq_len, layers, heads and width: {config})")
        used.add(name)
        return value

    shapes = {"ln1": (D,), "ln1_b": (D,), "qkv": (D, 3 * D), "qkv_b": (3 * D,), "proj": (D, D), "proj_b": (D,),
              "ln2": (D,), "ln2_b": (D,), "fc": (D, F), "fc_b": (F,), "out": (F, D), "out_b": (D,)}
    stages = {ours: np.stack([take(f"h.{i}.{theirs}", shapes[ours]) for i in range(L)])
              for ours, theirs in _BLOCK.items()}
    stages["qkv"] = stages["qkv"].reshape(L, D, 3, H, D // H)
    stages["qkv_b"] = stages["qkv_b"].reshape(L, 3, H, D // H)
    stages["proj"] = stages["proj"].reshape(L, H, D // H, D)
    wte = np.zeros((config.padded_vocab, D), np.float32)
    wte[:config.vocab] = take("wte.weight", (config.vocab, D))
    held = by_name["wpe.weight"].shape[0] if "wpe.weight" in by_name else config.seq_len  # missing: take says so
    if held < config.seq_len:
        raise ConfigError(f"{path}: wpe.weight holds {held} positions, this GPT needs "
                          f"{named('seq_len', config.seq_len)}: give a shorter seq_len")
    wpe = take("wpe.weight", (held, D))[:config.seq_len]
    head = {"ln": take("ln_f.weight", (D,)), "ln_b": take("ln_f.bias", (D,))}
    if "lm_head.weight" in by_name:  # tied: the same numbers as wte, or a head this GPT does not have
        if not np.array_equal(take("lm_head.weight", (config.vocab, D)), wte[:config.vocab]):
            raise ConfigError(f"{path}: lm_head.weight differs from wte.weight: jaxtrain's GPT ties them")
    left = sorted(k for k in by_name if k not in used and not k.endswith(_BUFFERS))
    if left:
        raise ConfigError(f"{path}: {len(left)} tensor(s) this GPT does not compute: {', '.join(left[:5])}"
                          f"{', ...' if len(left) > 5 else ''}")
    return {"embed": {"wte": wte, "wpe": wpe}, "stages": stages, "head": head}


def export(params: dict, config) -> dict[str, np.ndarray]:
    """``params`` (the GPT's) as ``GPT2LMHeadModel``'s ``state_dict``: what ``load_state_dict`` takes strictly."""
    learned_positions(config, "a Hugging Face GPT-2 file")
    L, D = config.layers, config.width
    stages = {k: np.asarray(v, np.float32) for k, v in params["stages"].items()}
    flat = {"qkv": (L, D, 3 * D), "qkv_b": (L, 3 * D), "proj": (L, D, D)}
    out = {}
    for ours, theirs in _BLOCK.items():
        stacked = stages[ours].reshape(flat[ours]) if ours in flat else stages[ours]
        out.update({f"{PREFIX}h.{i}.{theirs}": stacked[i] for i in range(L)})
    wte = np.asarray(params["embed"]["wte"], np.float32)[:config.vocab]
    out.update({f"{PREFIX}wte.weight": wte, f"{PREFIX}wpe.weight": np.asarray(params["embed"]["wpe"], np.float32),
                f"{PREFIX}ln_f.weight": np.asarray(params["head"]["ln"], np.float32),
                f"{PREFIX}ln_f.bias": np.asarray(params["head"]["ln_b"], np.float32), "lm_head.weight": wte})
    return out


def learned_positions(config, what: str) -> None:
    """A ConfigError where ``config`` (a ``gpt.Config``) has rotary positions: GPT-2's are a learned embedding."""
    if config.rotary:
        raise ConfigError(f"{what} holds GPT-2's learned positions (wpe), and this GPT's are rotary "
                          f"({named('rotary', True)}): only a GPT trained without {named('rotary', True)} "
                          "goes to or from GPT-2's files")


def save(params: dict, config, path: str | Path) -> Path:
    """``export``'s tensors as a safetensors file at ``path`` (transformers' ``model.safetensors`` names)."""
    return tensors.write(export(params, config), path)
