"""What a loss_fn may ask of the train step while it is traced: ``step_context()`` (a ``StepContext``).

It holds the axis the batch is split over where the loss runs
(BatchNorm averages over it: ``jaxtrain.nn.flax_nnx``), the mesh (the Pallas
kernels split their rows over it), the step's key and the examples' rows
(``dropout``). It is made here (``shard_context``) and nowhere else, and set while the step
(``jaxtrain.core.step``) traces the loss.

The keys (``state.rng`` is ``trainer.init``'s ``rng``; ``d`` the shard's
index along "data"; ``k`` the scan micro-batches)::

    step_key = fold_in(state.rng, state.step)
    key      = fold_in(step_key, d)     shard_map, ring, pmap; jit, explicit with accumulation (d: its shard)
             = fold_in(step_key, 0)     plain jit, explicit: one program sees the whole batch
    micro-batch m of k (scan): split(key, k)[m]

So the same seed, strategy, device count and accumulation give the same
draws, bit for bit. Draws made with ``key`` over a shard's rows differ
between strategies and device counts; ``dropout`` does not: each example's
mask comes from ``fold_in(step_key, its row in the update's whole batch)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What one shard's loss is computed under: made by ``shard_context`` (where the step runs a shard), read
    through ``step_context()``.

    ``key``: the loss_fn's key; ``step_key`` and ``rows`` (the examples' rows in the update's whole batch):
    per-example draws (``dropout``); ``batch_axis``: the mesh axis the batch is split over where the loss
    runs (None: the loss sees the whole batch); ``mesh``: the step's mesh; ``vary``: marks fresh values as
    differing per shard (zeros that accumulate per-shard gradients under ``shard_map``)."""

    key: jax.Array
    step_key: jax.Array
    rows: jax.Array
    batch_axis: str | None
    mesh: jax.sharding.Mesh
    vary: Callable = lambda tree: tree


_ACTIVE = contextvars.ContextVar("jaxtrain_step", default=None)  # (StepContext, [draws so far])


def step_context() -> StepContext | None:
    """The context of the train step being traced (None outside one, e.g. in evaluation)."""
    active = _ACTIVE.get()
    return active[0] if active else None


@contextlib.contextmanager
def traced_under(ctx: StepContext):
    """The step's forward and backward pass are traced under ``ctx`` (``step_context()`` reads it)."""
    token = _ACTIVE.set((ctx, [0]))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def local_rows(batch, first: jax.Array | int = 0) -> jax.Array:
    """Rows ``first .. first + B - 1`` for a batch of B examples (B: its leaves' leading size)."""
    return first + jnp.arange(jax.tree.leaves(batch)[0].shape[0], dtype=jnp.int32)


def shard_context(step_key: jax.Array, batch, mesh: jax.sharding.Mesh, index: jax.Array | None = None,
                  axis=None, vary: Callable | None = None) -> StepContext:
    """The ``StepContext`` of the shard a strategy runs ``local`` on; the only place one is made (the key rule
    of the module docstring). ``index``: the shard's place along the batch axes ``axis``, its examples the
    ``index``-th block of the update's batch (None: one program sees the whole batch, under "jit")."""
    if index is None:
        return StepContext(key=jax.random.fold_in(step_key, 0), step_key=step_key, rows=local_rows(batch),
                           batch_axis=None, mesh=mesh)
    return StepContext(key=jax.random.fold_in(step_key, index), step_key=step_key, batch_axis=axis, mesh=mesh,
                       rows=local_rows(batch, index * jax.tree.leaves(batch)[0].shape[0]), vary=vary)


def example_keys(salt: int | None = None) -> jax.Array:
    """One key per example of the loss_fn's batch, the same for that example under any strategy or device count.

    Each call draws fresh keys (a per-step call counter is folded in), unless ``salt`` fixes it.
    """
    active = _ACTIVE.get()
    if active is None:
        raise ConfigError("jt.dropout / jt.example_keys work inside a jaxtrain train step's loss_fn only: pass "
                          "deterministic=True outside one (evaluation)")
    ctx, calls = active
    if salt is None:
        salt, calls[0] = calls[0], calls[0] + 1
    key = jax.random.fold_in(ctx.step_key, salt)
    return jax.vmap(jax.random.fold_in, (None, 0))(key, ctx.rows)


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
    keep_p = jnp.float32(1.0 - rate)  # fp32 draws: the same masks in a float64 run (the tests' exact values)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, keep_p, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def auto_axes(fn: Callable) -> Callable:
    """``fn`` (a loss_fn or eval_fn that knows no mesh) under ``jax.sharding.auto_axes``: inside, the mesh's axes
    are Auto again, so GSPMD shards the model's insides (a reshape or a pooling of batch-sharded activations needs
    no annotation); its outputs come back replicated (scalars). The step's context goes in with it: its arrays as
    arguments (an Explicit-typed value cannot be read inside), its draws counted on."""

    def run(*args):
        active = _ACTIVE.get()
        current = jax.sharding.get_abstract_mesh()  # inside shard_map, "data" is Manual: only the rest turn Auto
        axes = tuple(a for a, t in zip(current.axis_names, current.axis_types) if t == jax.sharding.AxisType.Explicit)
        if not axes:
            return fn(*args)

        def inside(args, arrays):
            if active is None:
                return fn(*args)
            token = _ACTIVE.set((dataclasses.replace(active[0], **arrays), active[1]))
            try:
                return fn(*args)
            finally:
                _ACTIVE.reset(token)

        arrays = {} if active is None else {k: getattr(active[0], k) for k in ("key", "step_key", "rows")}
        return jax.sharding.auto_axes(inside, axes=axes, out_sharding=P())(args, arrays)

    return run
