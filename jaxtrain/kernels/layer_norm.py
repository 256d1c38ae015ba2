"""Layer norm over the last axis as Pallas kernels: statistics, normalisation, scale and shift in one pass.

x [..., D] is seen as rows [N, D] in row blocks (jaxtrain.kernels.rows). Forward: per row the mean and
``rstd = 1/sqrt(var + eps)`` (kept for the backward), ``y = (x - mean) * rstd * scale + bias`` in x's dtype,
statistics in fp32. Backward, with ``xhat = (x - mean) * rstd`` and ``g = dy * scale``:
``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` per row; ``dscale = sum(dy * xhat)`` and
``dbias = sum(dy)`` over the rows, each program writing its block's partial sums (no atomics: the result does
not depend on the order programs run in), summed in ``jnp`` after (by ``rows.run``, and over the devices here).
``reference`` is the ViT's layer norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.kernels import mosaic
from jaxtrain.kernels import rows as rb

EPS = 1e-6  # the ViT's


def reference(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = EPS) -> jax.Array:
    """Layer norm of x's last axis in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean, var = x32.mean(-1, keepdims=True), x32.var(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def _forward_kernel(x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref, *, rows, cols, triton):
    row_ok, col_ids, valid = rb.tile(rows, cols)
    x = rb.read(x_ref, valid, 0, triton).astype(jnp.float32)
    mean = jnp.sum(x, axis=1) / cols  # padding reads as 0
    centred = jnp.where(valid, x - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(centred * centred, axis=1) / cols + EPS)
    in_row = col_ids < cols
    scale = rb.read(scale_ref, in_row, 0, triton).astype(jnp.float32)
    bias = rb.read(bias_ref, in_row, 0, triton).astype(jnp.float32)
    y = centred * rstd[:, None] * scale[None, :] + bias[None, :]
    rb.write(y_ref, y.astype(y_ref.dtype), valid, triton)
    rb.write(mean_ref, mean, row_ok, triton)
    rb.write(rstd_ref, rstd, row_ok, triton)


def _backward_kernel(x_ref, scale_ref, dy_ref, mean_ref, rstd_ref, dx_ref, dscale_ref, dbias_ref, *, rows, cols,
                     triton):
    row_ok, col_ids, valid = rb.tile(rows, cols)
    mean, rstd = rb.read(mean_ref, row_ok, 0.0, triton), rb.read(rstd_ref, row_ok, 0.0, triton)
    x = rb.read(x_ref, valid, 0, triton).astype(jnp.float32)
    xhat = jnp.where(valid, (x - mean[:, None]) * rstd[:, None], 0.0)  # padding at 0
    dy = rb.read(dy_ref, valid, 0, triton).astype(jnp.float32)
    g = dy * rb.read(scale_ref, col_ids < cols, 0, triton).astype(jnp.float32)[None, :]
    mean_g = jnp.sum(g, axis=1) / cols
    mean_gx = jnp.sum(g * xhat, axis=1) / cols
    dx = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
    rb.write(dx_ref, dx.astype(dx_ref.dtype), valid, triton)
    in_row = (col_ids < cols)[None, :]
    rb.write(dscale_ref, jnp.sum(dy * xhat, axis=0)[None, :], in_row, triton)  # this block's partial sums
    rb.write(dbias_ref, jnp.sum(dy, axis=0)[None, :], in_row, triton)


def _forward(x, scale, bias):
    rows2 = x.reshape(-1, x.shape[-1])
    stat = (rb.ROW, jnp.float32)
    y, mean, rstd = rb.run(_forward_kernel, (rows2, scale, bias), (rb.ROWS, rb.COLS, rb.COLS),
                           [(rb.ROWS, x.dtype), stat, stat], *rows2.shape,
                           mosaic=lambda *a, **kw: mosaic.ln_forward(*a, EPS, **kw))
    return y.reshape(x.shape), (mean, rstd)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """Layer norm of x's last axis (statistics in fp32, eps 1e-6), scaled and shifted; in x's dtype."""
    # Inside shard_map, scale and bias enter varying like x: the kernel's partial sums of their gradients are
    # per device, and the transpose of this cast is the sum over the devices that jnp's layer norm would do.
    return _layer_norm(x, *rb.vary_like((scale, bias), x))


@jax.custom_vjp
def _layer_norm(x, scale, bias):
    return _forward(x, scale, bias)[0]


def _layer_norm_fwd(x, scale, bias):
    y, (mean, rstd) = _forward(x, scale, bias)
    return y, (x, scale, bias, mean, rstd)


def _layer_norm_bwd(residuals, dy):
    x, scale, bias, mean, rstd = residuals
    rows2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, x.shape[-1])
    partial = (rb.BLOCK, jnp.float32)
    dx, dscale, dbias = rb.run(_backward_kernel, (rows2, scale, dy2, mean, rstd),
                               (rb.ROWS, rb.COLS, rb.ROWS, rb.ROW, rb.ROW), [(rb.ROWS, x.dtype), partial, partial],
                               *rows2.shape, mosaic=mosaic.ln_backward)
    return dx.reshape(x.shape), dscale.sum(0).astype(scale.dtype), dbias.sum(0).astype(bias.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)
