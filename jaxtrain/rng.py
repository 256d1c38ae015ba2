"""The keys a ``loss_fn`` receives, and dropout that is the same under every strategy and device count.

The rule (``state.rng`` is ``trainer.init``'s ``rng``; ``d`` the device's
index along "data"; ``k`` the scan micro-batches):

    step_key = fold_in(state.rng, state.step)
    rng      = fold_in(step_key, d)          shard_map, ring, pmap; jit with accumulation (d: its shard)
             = fold_in(step_key, 0)          plain jit: one program sees the whole batch
    micro-batch m of k (scan): split(rng, k)[m]

So the same seed, strategy, device count and accumulation give the same
draws, bit for bit; devices draw from different keys. Draws made with
``rng`` over a device's rows differ between strategies and device counts
(the rows a key covers differ). ``jt.dropout`` does not: each example's mask
comes from ``fold_in(step_key, its row in the update's whole batch)``, so an
example gets the same mask under every strategy, device count and scan
accumulation (``multisteps`` makes every micro-batch a step of its own).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jaxtrain.errors import ConfigError

_EXAMPLES = contextvars.ContextVar("jaxtrain_examples", default=None)


@contextlib.contextmanager
def examples(step_key: jax.Array, rows: jax.Array):
    """Inside a train step: the step's key and the global rows of the examples the loss_fn sees."""
    token = _EXAMPLES.set({"key": step_key, "rows": rows, "calls": 0})
    try:
        yield
    finally:
        _EXAMPLES.reset(token)


def local_rows(batch, first: jax.Array | int = 0) -> jax.Array:
    """Rows ``first .. first + B - 1`` for a batch of B examples (B: its leaves' leading size)."""
    return first + jnp.arange(jax.tree.leaves(batch)[0].shape[0], dtype=jnp.int32)


def example_keys(salt: int | None = None) -> jax.Array:
    """One key per example of the loss_fn's batch, the same for that example under any strategy or device count.

    Each call draws fresh keys (a per-step call counter is folded in), unless ``salt`` fixes it.
    """
    ctx = _EXAMPLES.get()
    if ctx is None:
        raise ConfigError("jt.dropout / jt.example_keys work inside a jaxtrain train step's loss_fn only: pass "
                          "deterministic=True outside one (evaluation)")
    if salt is None:
        salt, ctx["calls"] = ctx["calls"], ctx["calls"] + 1
    key = jax.random.fold_in(ctx["key"], salt)
    return jax.vmap(jax.random.fold_in, (None, 0))(key, ctx["rows"])


def dropout(x: jax.Array, rate: float, *, deterministic: bool = False, salt: int | None = None) -> jax.Array:
    """Inverted dropout of ``x`` [B, ...] (B: the loss_fn's examples), each example's mask from its own key."""
    if deterministic or rate == 0.0:
        return x
    if not 0.0 <= rate < 1.0:
        raise ConfigError(f"dropout rate must be in [0, 1), got {rate}")
    keys = example_keys(salt)
    if keys.shape[0] != x.shape[0]:
        raise ConfigError(f"jt.dropout: x has {x.shape[0]} rows but the loss_fn's batch has {keys.shape[0]} "
                          "examples: dropout acts on per-example activations [batch, ...]")
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
