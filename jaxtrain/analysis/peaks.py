"""The dense peak FLOP/s of a real GPU, for a run's MFU, from the vendors' published specifications
(``targets.json``: the GPU targets the planner compiles for, and boards known only by their peaks).

Here rather than in ``gpu/``, so that a training run reads a peak without importing the GPU planner.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources

__all__ = ["board", "dense_peak", "peak_flops", "specs"]


@functools.cache
def specs() -> dict:
    """``targets.json`` as it stands: the targets by key, ``"_boards"`` (peaks only) and ``"_costs"``."""
    return json.loads(resources.files("jaxtrain.analysis").joinpath("targets.json").read_text())


def dense_peak(peak_tflops: dict, precision: str) -> float:
    """Dense FLOP/s for a run's precision: tensor cores in bf16/fp16, TF32 for fp32 (XLA's default for f32
    matmuls on these GPUs); where the GPU has no such tensor cores, its fp32 peak (V100, T4: no TF32 or bf16)."""
    key = {"fp32": "tf32"}.get(precision, precision)
    return peak_tflops.get(key, peak_tflops["fp32"]) * 1e12


def peak_flops(device_kind: str, precision: str) -> float | None:
    """The dense peak FLOP/s, for a run's precision, of the real GPU JAX names ``device_kind`` (e.g. "NVIDIA H100
    PCIe"): a target's, or one of the boards ``targets.json`` knows only by their peaks ("_boards"); None for
    another device. The most specific name wins: "h100 pcie" before "h100"."""
    key = board(device_kind)
    if key is None:
        return None
    return dense_peak((_targets().get(key) or specs()["_boards"][key])["peak_tflops"], precision)


def board(device_kind: str) -> str | None:
    """The key, of the targets and ``_boards``, whose words all name ``device_kind``: the most specific first."""
    words = set(re.split(r"[^A-Z0-9]+", device_kind.upper()))
    keys = [*_targets(), *(k for k in specs()["_boards"] if not k.startswith("_"))]
    return next((k for k in sorted(keys, key=lambda k: -len(k.split())) if set(k.upper().split()) <= words), None)


def _targets() -> dict:
    return {key: spec for key, spec in specs().items() if not key.startswith("_")}
