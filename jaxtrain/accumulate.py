"""Gradient accumulation: micro-batches under lax.scan, or optax.MultiSteps.

``scan`` (default): one call of the step is one optimizer update. Each device
splits its share of the batch into k micro-batches and scans over them,
summing fp32 gradients and metrics; the cross-device reduction happens once,
after the loop. ``multisteps``: ``optax.MultiSteps`` wraps the optimizer, one
call takes one micro-batch, and the update lands every k-th call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxtrain.choices import ACCUM_MODES
from jaxtrain.errors import ConfigError

MODES = ACCUM_MODES


def check(accum_steps: int, accum: str) -> None:
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ConfigError(f"accum_steps must be a whole number >= 1, got {accum_steps!r}")
    if accum not in MODES:
        raise ConfigError(f"unknown accum {accum!r}: use one of {', '.join(MODES)}")


def wrap_optimizer(tx: optax.GradientTransformation, accum_steps: int, accum: str):
    """The optimizer the step uses: ``tx``, or ``optax.MultiSteps(tx, k)``."""
    if accum == "multisteps" and accum_steps > 1:
        return optax.MultiSteps(tx, every_k_schedule=accum_steps)
    return tx


def split_micro_batches(batch, k: int):
    """[B, ...] -> [k, B/k, ...] with micro-batch j = rows j, j+k, j+2k, ...

    Strided rather than contiguous so that a batch sharded in contiguous
    blocks over devices stays local: every device holds B/(n k) rows of
    every micro-batch, and no data moves.
    """

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _platform_scan(step, carry, xs, k: int):
    """``lax.scan(step, carry, xs)``, fully unrolled when compiled for a CPU.

    XLA:CPU runs convolutions inside a ``while`` body many times slower than
    the same ops outside one (jax-ml/jax#12868). So on CPU no loop is left (compile time grows
    with k); GPUs and TPUs keep the loop. ``lax.platform_dependent`` chooses
    when the step is lowered, for the platform it is compiled FOR, not the
    host's (a CUDA lowering on a CPU host keeps the loop; the compiler never
    sees a conditional).
    """
    scan = lambda unroll: lambda c, x: lax.scan(step, c, x, unroll=unroll)  # noqa: E731
    return lax.platform_dependent(carry, xs, cpu=scan(k), default=scan(1))


def scan_gradients(grad_fn, params, model_state, batch, rng, k: int, vary):
    """Sum ``grad_fn`` over k micro-batches with ``lax.scan``; return the means.

    ``grad_fn(params, model_state, micro_batch, rng) -> (grads, loss, model_state, metrics)``.
    ``vary`` marks the zero carries per-device (shard_map), matching ``params``.
    """
    micro = split_micro_batches(batch, k)
    rngs = jax.random.split(rng, k)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(grad_fn, params, model_state, first, rngs[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (shapes[0], shapes[1], shapes[3]))
    carry0 = (vary(zeros), model_state)

    def step(carry, xs):
        (g_sum, loss_sum, m_sum), ms = carry
        mb, r = xs
        g, loss, ms, metrics = grad_fn(params, ms, mb, r)
        acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), (g_sum, loss_sum, m_sum), (g, loss, metrics))
        return (acc, ms), None

    ((g_sum, loss_sum, m_sum), model_state), _ = _platform_scan(step, carry0, (micro, rngs), k)
    mean = lambda t: jax.tree.map(lambda x: x / k, t)  # noqa: E731
    return mean(g_sum), mean(loss_sum), model_state, mean(m_sum)
