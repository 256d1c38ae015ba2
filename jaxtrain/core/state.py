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


@struct.dataclass
class Frozen:
    """Model state the train step carries but never changes or reduces: ``model_state={"teacher": Frozen(tree)}``.

    A distillation teacher's weights are step inputs like BatchNorm statistics
    (on the devices, donated, checkpointed with the state) but constant: the
    step hands the loss the same values every time and returns them
    bit-identical, and strategies that average the model state over devices
    (shard_map, ring, pmap) leave them out of that all-reduce.
    """

    tree: Any


def is_frozen(x) -> bool:
    return isinstance(x, Frozen)


def keep_frozen(new, old):
    """``new`` model state with each ``Frozen`` part taken from ``old`` (what the step was given)."""
    return jax.tree.map(lambda n, o: o if is_frozen(o) else n, new, old, is_leaf=is_frozen)


def map_unfrozen(fn, tree):
    """``fn(list of leaves) -> list``, applied to the leaves outside any ``Frozen`` part (in one call)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_frozen)
    moving = [i for i, x in enumerate(leaves) if not is_frozen(x)]
    for i, x in zip(moving, fn([leaves[i] for i in moving]) if moving else ()):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
