"""Softmax cross-entropy with integer labels as Pallas kernels: one pass over the logits forward, one backward.

Logits [B, C] in row blocks (jaxtrain.kernels.rows: [R, next_pow2(C)] tiles, R = 16 rows up to 1024 classes). Forward:
each row's logsumexp (max-shifted) and its loss ``lse - logit[label]``, both kept (the backward needs lse, not
the softmax). Backward: ``g * (exp(logit - lse) - onehot(label))`` in the logits' dtype. ``reference`` is the
same maths in ``jnp``; ``cross_entropy`` is the kernel pair under ``jax.custom_vjp`` (docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.kernels import mosaic
from jaxtrain.kernels import rows as rb


def reference(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example ``logsumexp(logits) - logits[label]`` in fp32: what the kernels compute."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def _load(logits_ref, labels_ref, rows, cols, triton):
    row_ok, col_ids, valid = rb.tile(rows, cols)
    x = rb.read(logits_ref, valid, 0, triton).astype(jnp.float32)
    x = jnp.where(col_ids[None, :] < cols, x, -jnp.inf)  # padded columns take no share of the softmax
    return x, rb.read(labels_ref, row_ok, 0, triton), row_ok, col_ids, valid


def _forward_kernel(logits_ref, labels_ref, loss_ref, lse_ref, *, rows, cols, triton):
    x, label, row_ok, col_ids, _ = _load(logits_ref, labels_ref, rows, cols, triton)
    peak = jnp.max(x, axis=1)
    lse = peak + jnp.log(jnp.sum(jnp.exp(x - peak[:, None]), axis=1))
    picked = jnp.sum(jnp.where(col_ids[None, :] == label[:, None], x, 0.0), axis=1)
    rb.write(loss_ref, lse - picked, row_ok, triton)
    rb.write(lse_ref, lse, row_ok, triton)


def _backward_kernel(logits_ref, labels_ref, lse_ref, g_ref, dlogits_ref, *, rows, cols, triton):
    x, label, row_ok, col_ids, valid = _load(logits_ref, labels_ref, rows, cols, triton)
    lse = rb.read(lse_ref, row_ok, 0.0, triton)
    g = rb.read(g_ref, row_ok, 0.0, triton).astype(jnp.float32)
    onehot = (col_ids[None, :] == label[:, None]).astype(jnp.float32)
    grad = g[:, None] * (jnp.exp(x - lse[:, None]) - onehot)
    rb.write(dlogits_ref, grad.astype(dlogits_ref.dtype), valid, triton)


def _forward(logits, labels):
    per_row = (rb.ROW, jnp.float32)
    return rb.run(_forward_kernel, (logits, labels.astype(jnp.int32)), (rb.ROWS, rb.ROW), [per_row, per_row],
                  *logits.shape, mosaic=mosaic.ce_forward)


@jax.custom_vjp
def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy [B] (fp32) of logits [B, C] (any float dtype) and integer labels [B]."""
    return _forward(logits, labels)[0]


def _cross_entropy_fwd(logits, labels):
    loss, lse = _forward(logits, labels)
    return loss, (logits, labels, lse)


def _cross_entropy_bwd(residuals, g):
    logits, labels, lse = residuals
    (dlogits,) = rb.run(_backward_kernel, (logits, labels.astype(jnp.int32), lse, g),
                        (rb.ROWS, rb.ROW, rb.ROW, rb.ROW), [(rb.ROWS, logits.dtype)], *logits.shape,
                        mosaic=lambda *a, **kw: (mosaic.ce_backward(*a, **kw),))
    return dlogits, None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
