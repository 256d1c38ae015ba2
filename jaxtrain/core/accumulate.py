"""Gradient accumulation: micro-batches under lax.scan, or optax.MultiSteps.

``scan`` (default): one call of the step is one optimizer update. Each device
splits its share of the batch into k micro-batches and scans over them,
summing fp32 gradients and metrics; the cross-device reduction happens once,
after the loop. ``multisteps``: ``optax.MultiSteps`` wraps the optimizer, one
call takes one micro-batch, and the update lands every k-th call.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxtrain.choices import ACCUM_MODES
from jaxtrain.errors import ConfigError, named

class Accum(str, enum.Enum):
    """How k micro-batches make one update: ``SCAN`` inside one call, ``MULTISTEPS`` one call each."""

    SCAN = "scan"
    MULTISTEPS = "multisteps"


MODES = ACCUM_MODES
assert tuple(m.value for m in Accum) == MODES


def check(accum_steps: int, accum: str | Accum) -> Accum:
    """``accum`` as an ``Accum``; a ConfigError for a bad count or mode."""
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ConfigError(f"{named('accum_steps', repr(accum_steps))}: must be a whole number >= 1")
    try:
        return Accum(accum)
    except ValueError:
        raise ConfigError(f"unknown {named('accum', repr(accum))}: use one of {', '.join(MODES)}") from None


def wrap_optimizer(tx: optax.GradientTransformation, accum_steps: int, accum: Accum):
    """The optimizer the step uses: ``tx``, or ``optax.MultiSteps(tx, k)``."""
    if accum == Accum.MULTISTEPS and accum_steps > 1:
        return optax.MultiSteps(tx, every_k_schedule=accum_steps)
    return tx


def scan_steps(accum_steps: int, accum: Accum) -> int:
    """Micro-batches inside one call of the step."""
    return accum_steps if accum == Accum.SCAN else 1


def split_micro_batches(batch, k: int):
    """[B, ...] -> [k, B/k, ...] with micro-batch j = rows j, j+k, j+2k, ...

    Strided rather than contiguous so that a batch sharded in contiguous
    blocks over devices stays local: every device holds B/(n k) rows of
    every micro-batch, and no data moves.
    """

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def platform_scan(step, carry, xs, k: int):
    """``lax.scan(step, carry, xs)``, fully unrolled when compiled for a CPU.

    XLA:CPU runs convolutions inside a ``while`` body many times slower than
    the same ops outside one (jax-ml/jax#12868; LeNet's K-step call 11x, docs/gpu-busy.md), and in another
    summation order (it canonicalizes convolutions in the entry computation only). So on CPU no loop is left
    (compile time grows with k); GPUs and TPUs keep the loop. The micro-batches here, and K steps a call
    (``step.scanned``). ``lax.platform_dependent`` chooses
    when the step is lowered, for the platform it is compiled FOR, not the
    host's (a CUDA lowering on a CPU host keeps the loop; the compiler never
    sees a conditional).
    """
    def scan(unroll):
        return lambda c, x: lax.scan(step, c, x, unroll=unroll)

    return lax.platform_dependent(carry, xs, cpu=scan(k), default=scan(1))


def microbatched(grads, k: int):
    """``grads(params, model_state, batch, ctx, scale) -> (grads, loss, model_state, metrics)`` over k
    micro-batches of ``batch`` under ``lax.scan``: the same signature, the means of the k results (model state
    threaded through). Micro-batch m gets ``split(ctx.key, k)[m]`` and its examples' rows (``ctx.rows``);
    ``ctx.vary`` marks the zero carries as differing per shard (``shard_map``), like the gradients."""

    def accumulated(params, model_state, batch, ctx, scale):
        micro = split_micro_batches((batch, ctx.rows), k)
        keys = jax.random.split(ctx.key, k)
        first = jax.tree.map(lambda x: x[0], micro)

        def one(ms, m, key):  # one micro-batch m = (batch, rows)
            return grads(params, ms, m[0], dataclasses.replace(ctx, key=key, rows=m[1]), scale)

        shapes = jax.eval_shape(one, model_state, first, keys[0])
        # Typed like the results (strategy="explicit": a tensor-parallel gradient's sharding is part of its type).
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32, out_sharding=s.sharding),
                             (shapes[0], shapes[1], shapes[3]))

        def step(carry, xs):
            (g_sum, loss_sum, m_sum), ms = carry
            g, loss, ms, metrics = one(ms, *xs)
            acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), (g_sum, loss_sum, m_sum), (g, loss, metrics))
            return (acc, ms), None

        ((g_sum, loss_sum, m_sum), model_state), _ = platform_scan(step, (ctx.vary(zeros), model_state),
                                                                   (micro, keys), k)

        def mean(t):
            return jax.tree.map(lambda x: x / k, t)

        return mean(g_sum), mean(loss_sum), model_state, mean(m_sum)

    return accumulated
