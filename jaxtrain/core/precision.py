"""Precision policies (fp32 | bf16 | fp16) and the dynamic loss scale of fp16.

Master params and optimizer state stay fp32. At the loss boundary params and
floating inputs are cast to the compute dtype; the loss comes back in fp32;
gradients arrive in fp32 (the cast's transpose) before the optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy.

    - ``compute_dtype``: dtype of params and floating inputs inside the loss.
    - ``param_dtype``: dtype of the master params (fp32).
    - ``output_dtype``: dtype of the loss returned to the step (fp32).
    - ``loss_scale``: None, or "dynamic" (fp16): the loss is multiplied by a
      scale held in TrainState; non-finite gradients skip the update and
      halve it; ``growth_interval`` finite steps in a row double it.
    - ``reduce_dtype``: dtype of the explicit cross-device gradient reduction
      (shard_map / pmap / ring; under "jit" XLA places the reduction itself).
    """

    compute_dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    loss_scale: str | None = None
    reduce_dtype: Any = jnp.float32
    growth_interval: int = 2000
    initial_scale: float = 2.0**15

    def __post_init__(self):
        if self.loss_scale not in (None, "dynamic"):
            raise ConfigError(f"loss_scale must be None or 'dynamic', got {self.loss_scale!r}")
        if self.growth_interval < 1:
            raise ConfigError(f"growth_interval must be >= 1, got {self.growth_interval}")


POLICIES = {
    "fp32": Precision(),
    "bf16": Precision(compute_dtype=jnp.bfloat16),
    "fp16": Precision(compute_dtype=jnp.float16, loss_scale="dynamic"),
}


def get_policy(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in POLICIES:
        raise ConfigError(f"unknown precision {precision!r}: use one of {', '.join(POLICIES)} or a jt.Precision")
    return POLICIES[precision]


def cast_floats(tree, dtype):
    """Cast the floating-point leaves of ``tree`` to ``dtype``; leave the rest."""

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x

    return jax.tree.map(cast, tree)


# ------------------------------------------------------------ loss scaling


def init_loss_scale(policy: Precision):
    """The loss-scale state kept in TrainState (None without loss scaling)."""
    if policy.loss_scale is None:
        return None
    return {"scale": jnp.asarray(policy.initial_scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32)}


def current_scale(loss_scale) -> jax.Array:
    return jnp.float32(1.0) if loss_scale is None else loss_scale["scale"]


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def update_loss_scale(loss_scale, finite: jax.Array, policy: Precision):
    """Halve on overflow; double after ``growth_interval`` finite steps in a row."""
    good = jnp.where(finite, loss_scale["good_steps"] + 1, 0)
    grow = good >= policy.growth_interval
    scale = jnp.where(finite, jnp.where(grow, loss_scale["scale"] * 2, loss_scale["scale"]),
                      jnp.maximum(loss_scale["scale"] / 2, 1.0))
    return {"scale": scale, "good_steps": jnp.where(grow, 0, good).astype(jnp.int32)}


def select_tree(pred: jax.Array, on_true, on_false):
    """``on_true`` where ``pred`` else ``on_false``, leaf by leaf (a skipped update)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
