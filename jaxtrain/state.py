"""TrainState: everything a train step reads and writes, as one pytree."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    """One pytree, donated to and returned by every train step.

    ``params`` and ``opt_state`` are the fp32 masters; ``model_state`` holds
    mutable collections (e.g. BatchNorm statistics); ``rng`` is the base key
    (each step folds in ``step``); ``loss_scale`` is used by fp16 policies.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    loss_scale: Any = None
