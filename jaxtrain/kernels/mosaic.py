"""The row kernels on Mosaic GPU, JAX's own GPU kernel backend (Hopper and newer; jax >= 0.12).

The same maths as the Triton kernels (softmax_ce, layer_norm), cut for Mosaic GPU's programming model: a CUDA
block per ``ROWS`` rows, one warpgroup (128 threads) holding a [ROWS, CHUNK] tile in the WGMMA register layout,
whose row reductions Mosaic GPU lowers natively. Columns stream through shared memory in CHUNK-wide steps
(``plgpu.emit_pipeline``: TMA copies, two steps in flight), so any row width fits: the cross-entropy keeps an
online logsumexp over the chunks (as flash attention does), the layer norm merges each chunk's mean and squared
deviation into the row's (Chan et al.), then makes a second pass to normalise.

TMA copies want arrays tiled by 8 rows and 128 bytes of columns: operands that are not are zero-padded first
(LeNet's 10 classes; a batch of 37), and the kernels mask the padding by the true sizes. A last row block or
column chunk that runs past the (padded) array is TMA's: reads of it are zeros, writes to it are dropped.

Each function takes ``interpret=True`` to run in Mosaic GPU's interpret mode on a CPU (tests: equal to the jnp
references there). ``rows.run`` chooses this backend or Triton (``rows.backend``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # rows per block: the WGMMA layout's row tile, one warpgroup
CHUNK = 128  # columns per pipeline step
ROW_TILE, COL_BYTES = 8, 128  # what TMA's tiling wants of an operand's shape

_TILE = plgpu.Layout.WGMMA
_ROW = _TILE.reduce(1)  # a value per row of a tile
_COL = _TILE.reduce(0)  # a value per column of a tile


def _pad_to(a, shape):
    return a if a.shape == shape else jnp.pad(a, [(0, n - m) for n, m in zip(shape, a.shape)])


def _padded(rows: int, cols: int, dtype) -> tuple[int, int]:
    return rows + -rows % ROW_TILE, cols + -cols % (COL_BYTES // jnp.dtype(dtype).itemsize)


def _kernel(name: str, body, out_type, rows: int, scratch: dict, interpret: bool):
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(pl.cdiv(rows, ROWS),),
                        grid_names=("rows",), kernel_name=name,
                        interpret=plgpu.InterpretGPUParams() if interpret else None)


def _load_rows(pairs, barriers):
    """Copy ``[(gmem row vector, smem [ROWS])]`` of this block in, then load each in the per-row layout."""
    rows = pl.ds(lax.axis_index("rows") * ROWS, ROWS)
    for k, (gmem, smem) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(gmem.at[rows], smem, barriers.at[k])
    for k in range(len(pairs)):
        plgpu.barrier_wait(barriers.at[k])
    return [plgpu.load(smem, layout=_ROW) for _, smem in pairs]


def _store_rows(pairs):
    """Write ``[(value per row, smem [ROWS], gmem row vector)]`` of this block out."""
    rows = pl.ds(lax.axis_index("rows") * ROWS, ROWS)
    for value, smem, _ in pairs:
        smem[...] = value
    plgpu.commit_smem()
    for _, smem, gmem in pairs:
        plgpu.copy_smem_to_gmem(smem, gmem.at[rows])
    plgpu.wait_smem_to_gmem(0)


def _columns(j, width):
    return j * width + plgpu.broadcasted_iota(jnp.int32, (ROWS, width), 1, layout=_TILE)


def _per_row(v, width):
    return lax.broadcast_in_dim(v, (ROWS, width), [0])


def _per_col(v):
    return lax.broadcast_in_dim(v, (ROWS, v.shape[0]), [1])


def _row_vector(value, dtype=jnp.float32):
    return plgpu.layout_cast(jnp.full((ROWS,), value, dtype), _ROW)


def _scratch(**kinds):
    return {name: plgpu.SMEM((ROWS,), dtype) for name, dtype in kinds.items()}


def _pipeline(body, cols: int, width: int, ins: int, **kw):
    """Stream ``ins`` [N, cols] operands through shared memory, a [ROWS, width] tile per step."""
    tile = pl.BlockSpec((ROWS, width), lambda j: (lax.axis_index("rows"), j))
    return plgpu.emit_pipeline(body, grid=(pl.cdiv(cols, width),), in_specs=[tile] * ins, max_concurrent_steps=2,
                               **kw)


def _write_tile(value, smem, gmem, j, width):
    """Write a [ROWS, width] tile to column chunk ``j`` of this block through ``smem`` (a TMA copy: rows or
    columns past the array are dropped). The previous tile's copy must have read ``smem`` first."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem.at[pl.ds(lax.axis_index("rows") * ROWS, ROWS), pl.ds(j * width, width)])


# --- softmax cross-entropy ---------------------------------------------------------------------------------------
def ce_forward(logits, labels, interpret: bool = False):
    """(loss, lse) per row [N] in fp32 of logits [N, C] and integer labels [N]."""
    n, c = logits.shape
    npad, cpad = _padded(n, c, logits.dtype)
    width = min(CHUNK, cpad)

    def body(x_gmem, label_gmem, loss_gmem, lse_gmem, label_smem, loss_smem, lse_smem, bars):
        (label,) = _load_rows([(label_gmem, label_smem)], bars)

        def step(idx, x_smem, carry):
            peak, total, picked = carry
            cols = _columns(idx[0], width)
            x = jnp.where(cols < c, plgpu.load(x_smem, layout=_TILE).astype(jnp.float32), -jnp.inf)
            new = jnp.maximum(peak, x.max(axis=1))
            total = total * jnp.exp(peak - new) + jnp.exp(x - _per_row(new, width)).sum(axis=1)
            picked = picked + jnp.where(cols == _per_row(label, width), x, 0.0).sum(axis=1)
            return new, total, picked

        init = (_row_vector(-jnp.inf), _row_vector(0.0), _row_vector(0.0))
        peak, total, picked = _pipeline(step, cpad, width, ins=1, init_carry=init)(x_gmem)
        lse = peak + jnp.log(total)
        _store_rows([(lse - picked, loss_smem, loss_gmem), (lse, lse_smem, lse_gmem)])

    out = [jax.ShapeDtypeStruct((npad,), jnp.float32)] * 2
    scratch = {**_scratch(label_smem=jnp.int32, loss_smem=jnp.float32, lse_smem=jnp.float32),
               "bars": plgpu.Barrier(num_barriers=1)}
    loss, lse = _kernel("ce_forward", body, out, npad, scratch, interpret)(
        _pad_to(logits, (npad, cpad)), _pad_to(labels.astype(jnp.int32), (npad,)))
    return loss[:n], lse[:n]


def ce_backward(logits, labels, lse, g, interpret: bool = False):
    """d loss / d logits [N, C] in the logits' dtype: ``g * (softmax(logits) - onehot(label))``."""
    n, c = logits.shape
    npad, cpad = _padded(n, c, logits.dtype)
    width = min(CHUNK, cpad)

    def body(x_gmem, label_gmem, lse_gmem, g_gmem, dx_gmem, label_smem, lse_smem, g_smem, dx_smem, bars):
        label, lse, g = _load_rows([(label_gmem, label_smem), (lse_gmem, lse_smem), (g_gmem, g_smem)], bars)

        def step(idx, x_smem):
            cols = _columns(idx[0], width)
            x = plgpu.load(x_smem, layout=_TILE).astype(jnp.float32)
            onehot = jnp.where(cols == _per_row(label, width), 1.0, 0.0)
            dx = _per_row(g, width) * (jnp.exp(x - _per_row(lse, width)) - onehot)
            _write_tile(dx, dx_smem, dx_gmem, idx[0], width)

        _pipeline(step, cpad, width, ins=1)(x_gmem)
        plgpu.wait_smem_to_gmem(0)

    scratch = {**_scratch(label_smem=jnp.int32, lse_smem=jnp.float32, g_smem=jnp.float32),
               "dx_smem": plgpu.SMEM((ROWS, width), logits.dtype), "bars": plgpu.Barrier(num_barriers=3)}
    rows = functools.partial(_pad_to, shape=(npad,))
    (dx,) = _kernel("ce_backward", body, [jax.ShapeDtypeStruct((npad, cpad), logits.dtype)], npad, scratch, interpret)(
        _pad_to(logits, (npad, cpad)), rows(labels.astype(jnp.int32)), rows(lse), rows(g.astype(jnp.float32)))
    return dx[:n, :c]


# --- layer norm ----------------------------------------------------------------------------------------------------
def _moments(x_gmem, cols: int, width: int):
    """Per row mean and sum of squared deviations over ``cols`` columns, merged chunk by chunk (Chan et al.)."""

    def step(idx, x_smem, carry):
        mean, m2 = carry
        start = idx[0] * width
        seen, here = start.astype(jnp.float32), jnp.minimum(width, cols - start).astype(jnp.float32)
        valid = _columns(idx[0], width) < cols
        x = jnp.where(valid, plgpu.load(x_smem, layout=_TILE).astype(jnp.float32), 0.0)
        chunk_mean = x.sum(axis=1) / here
        chunk_m2 = jnp.where(valid, (x - _per_row(chunk_mean, width)) ** 2, 0.0).sum(axis=1)
        delta, total = chunk_mean - mean, seen + here
        return mean + delta * (here / total), m2 + chunk_m2 + delta * delta * (seen * here / total)

    return _pipeline(step, cols, width, ins=1, init_carry=(_row_vector(0.0), _row_vector(0.0)))(x_gmem)


def ln_forward(x, scale, bias, eps: float, interpret: bool = False):
    """(y [N, D] in x's dtype, mean [N], rstd [N]) of the layer norm of rows x [N, D]."""
    n, d = x.shape
    npad, dpad = _padded(n, d, x.dtype)
    width = min(CHUNK, dpad)

    def body(x_gmem, scale_gmem, bias_gmem, y_gmem, mean_gmem, rstd_gmem, mean_smem, rstd_smem, y_smem):
        mean, m2 = _moments(x_gmem, d, width)
        rstd = lax.rsqrt(m2 / d + eps)

        def step(idx, x_smem):
            chunk = pl.ds(idx[0] * width, width)
            scale = plgpu.load(scale_gmem.at[chunk], layout=_COL).astype(jnp.float32)
            bias = plgpu.load(bias_gmem.at[chunk], layout=_COL).astype(jnp.float32)
            xhat = ((plgpu.load(x_smem, layout=_TILE).astype(jnp.float32) - _per_row(mean, width))
                    * _per_row(rstd, width))
            _write_tile(xhat * _per_col(scale) + _per_col(bias), y_smem, y_gmem, idx[0], width)

        _pipeline(step, dpad, width, ins=1)(x_gmem)
        _store_rows([(mean, mean_smem, mean_gmem), (rstd, rstd_smem, rstd_gmem)])

    out = [jax.ShapeDtypeStruct((npad, dpad), x.dtype)] + [jax.ShapeDtypeStruct((npad,), jnp.float32)] * 2
    scratch = {**_scratch(mean_smem=jnp.float32, rstd_smem=jnp.float32), "y_smem": plgpu.SMEM((ROWS, width), x.dtype)}
    vec = functools.partial(_pad_to, shape=(dpad + width,))  # a whole chunk past the end: read, never used
    y, mean, rstd = _kernel("ln_forward", body, out, npad, scratch, interpret)(
        _pad_to(x, (npad, dpad)), vec(scale.astype(jnp.float32)), vec(bias.astype(jnp.float32)))
    return y[:n, :d], mean[:n], rstd[:n]


def ln_backward(x, scale, dy, mean, rstd, interpret: bool = False):
    """(dx [N, D] in x's dtype, dscale [D], dbias [D] in fp32) of the layer norm, given dy and the forward's
    mean and rstd: ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * scale``."""
    n, d = x.shape
    npad, dpad = _padded(n, d, x.dtype)
    width = min(CHUNK, dpad)
    blocks = pl.cdiv(npad, ROWS)

    def body(x_gmem, scale_gmem, dy_gmem, mean_gmem, rstd_gmem, dx_gmem, dscale_gmem, dbias_gmem,
             mean_smem, rstd_smem, dx_smem, bars):
        mean, rstd = _load_rows([(mean_gmem, mean_smem), (rstd_gmem, rstd_smem)], bars)

        def terms(j, x_smem, dy_smem):
            scale = plgpu.load(scale_gmem.at[pl.ds(j * width, width)], layout=_COL).astype(jnp.float32)
            xhat = ((plgpu.load(x_smem, layout=_TILE).astype(jnp.float32) - _per_row(mean, width))
                    * _per_row(rstd, width))
            dy = plgpu.load(dy_smem, layout=_TILE).astype(jnp.float32)
            return xhat, dy, dy * _per_col(scale)

        def sums(idx, x_smem, dy_smem, carry):
            xhat, _, g = terms(idx[0], x_smem, dy_smem)
            return carry[0] + g.sum(axis=1), carry[1] + (g * xhat).sum(axis=1)

        sum_g, sum_gx = _pipeline(sums, dpad, width, ins=2, init_carry=(_row_vector(0.0), _row_vector(0.0)))(
            x_gmem, dy_gmem)
        mean_g, mean_gx = sum_g / d, sum_gx / d

        def grads(idx, x_smem, dy_smem):
            xhat, dy, g = terms(idx[0], x_smem, dy_smem)
            dx = _per_row(rstd, width) * (g - _per_row(mean_g, width) - xhat * _per_row(mean_gx, width))
            _write_tile(dx, dx_smem, dx_gmem, idx[0], width)
            chunk = (lax.axis_index("rows"), pl.ds(idx[0] * width, width))
            dscale_gmem[chunk] = (dy * xhat).sum(axis=0)  # this block's partial sums (padding rows are 0)
            dbias_gmem[chunk] = dy.sum(axis=0)

        _pipeline(grads, dpad, width, ins=2)(x_gmem, dy_gmem)
        plgpu.wait_smem_to_gmem(0)

    partial = jax.ShapeDtypeStruct((blocks, dpad + width), jnp.float32)
    out = [jax.ShapeDtypeStruct((npad, dpad), x.dtype), partial, partial]
    scratch = {**_scratch(mean_smem=jnp.float32, rstd_smem=jnp.float32), "dx_smem": plgpu.SMEM((ROWS, width), x.dtype),
               "bars": plgpu.Barrier(num_barriers=2)}
    rows = functools.partial(_pad_to, shape=(npad,))
    dx, dscale, dbias = _kernel("ln_backward", body, out, npad, scratch, interpret)(
        _pad_to(x, (npad, dpad)), _pad_to(scale.astype(jnp.float32), (dpad + width,)), _pad_to(dy, (npad, dpad)),
        rows(mean), rows(rstd))
    return dx[:n, :d], dscale.sum(0)[:d], dbias.sum(0)[:d]
