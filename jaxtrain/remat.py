"""Rematerialization: policy names -> ``jax.checkpoint`` with that policy.

A remat policy decides which intermediate values of a block are saved for
the backward pass; the rest is recomputed there. Names:

- ``none``: no remat, everything the backward pass needs is saved;
- ``full``: save nothing inside the block (only its inputs), recompute all;
- ``dots``: save matmul/conv results, recompute the cheap elementwise ops;
- ``dots_no_batch``: save only matmuls without batch dimensions;
- any other attribute of ``jax.checkpoint_policies`` that is a policy itself
  (e.g. ``everything_saveable``, ``nothing_saveable``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax

from jaxtrain.errors import ConfigError

_ALIASES = {
    "full": "nothing_saveable",
    "dots": "dots_saveable",
    "dots_no_batch": "dots_with_no_batch_dims_saveable",
}


def _is_policy(obj) -> bool:
    """A policy takes (primitive, *avals, **params); factories (save_only_these_names) take no **params."""
    if not callable(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_KEYWORD for p in params)


def names() -> list[str]:
    """Every name ``policy`` accepts."""
    own = [n for n in dir(jax.checkpoint_policies) if not n.startswith("_")
           and _is_policy(getattr(jax.checkpoint_policies, n))]
    return ["none", *_ALIASES, *sorted(set(own) - set(_ALIASES.values())), *_ALIASES.values()]


def policy(name: str):
    """The ``jax.checkpoint_policies`` member for ``name`` (None for ``none``)."""
    if name == "none":
        return None
    attr = _ALIASES.get(name, name)
    obj = getattr(jax.checkpoint_policies, attr, None)
    if obj is None or not _is_policy(obj):
        raise ConfigError(f"unknown remat policy {name!r}: use one of {', '.join(names())}")
    return obj


def remat(fn: Callable, name: str) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the named policy (``fn`` for ``none``)."""
    pol = policy(name)
    return fn if pol is None else jax.checkpoint(fn, policy=pol)
