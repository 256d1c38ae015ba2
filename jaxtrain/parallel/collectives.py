"""The collectives of a per-device step: ``lax``'s, or our own ring written with ``lax.ppermute``.

``Comm`` bundles what a strategy's per-device function uses (``make_comm``);
the ring collectives below are all-reduce, reduce-scatter and all-gather.

Inside ``shard_map`` (or ``pmap``) over n devices along ``axis_name``. Each
works on a pytree: leaves of one dtype are packed into ONE buffer of n rows,
so a whole gradient tree moves in n-1 neighbour-to-neighbour steps per phase,
however many leaves it has.

- ``ring_reduce_scatter``: in each of n-1 steps every device passes one row to
  its right neighbour, which adds it to its own copy; afterwards device i
  holds the complete sum of row i (``lax.psum_scatter(..., tiled=True)``).
- ``ring_all_gather``: n-1 more steps pass the finished rows around the ring
  (``lax.all_gather(..., tiled=True)``).
- ``ring_allreduce``: the two in a row (``lax.psum``).

Why bandwidth-optimal: in the all-reduce each device sends and receives
2(n-1)/n of the data in total, whatever n is, and every link of the ring is
busy in every step. Summing at one device and broadcasting back moves (n-1)
times the data through that device. No algorithm can do with less than
2(n-1)/n per device: every device must send out its (n-1)/n share of
contributions and receive the (n-1)/n of the result it did not compute. This
is the algorithm NCCL and XLA use for large all-reduces; the tests check each
of the three against its ``lax`` built-in. FSDP uses the two halves apart:
reduce-scatter for the gradients, all-gather for the parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel.devices import DATA_AXIS
from jaxtrain.parallel.sharding import axes_of


def _right(n: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)]


def _reduce_scatter_rows(buf, axis_name: str):
    """[n, c] on each device -> [c]: row i of the sum over devices, on device i."""
    n, idx = buf.shape[0], lax.axis_index(axis_name)
    for s in range(n - 1):
        send = lax.dynamic_index_in_dim(buf, (idx - s - 1) % n, keepdims=False)
        recv = lax.ppermute(send, axis_name, _right(n))
        slot = (idx - s - 2) % n
        mine = lax.dynamic_index_in_dim(buf, slot, keepdims=False)
        buf = lax.dynamic_update_index_in_dim(buf, mine + recv, slot, 0)
    return lax.dynamic_index_in_dim(buf, idx, keepdims=False)


def _all_gather_rows(row, axis_name: str, n: int):
    """[c] on device i (row i) -> [n, c]: every device's row, on every device."""
    idx = lax.axis_index(axis_name)
    buf = lax.dynamic_update_index_in_dim(jnp.zeros((n, *row.shape), row.dtype), row, idx, 0)
    for s in range(n - 1):
        send = lax.dynamic_index_in_dim(buf, (idx - s) % n, keepdims=False)
        recv = lax.ppermute(send, axis_name, _right(n))
        buf = lax.dynamic_update_index_in_dim(buf, recv, (idx - s - 1) % n, 0)
    return buf


def _by_dtype(leaves):
    """Indices of ``leaves`` grouped by dtype (one packed buffer each)."""
    groups: dict = {}
    for i, x in enumerate(leaves):
        groups.setdefault(jnp.result_type(x), []).append(i)
    return [groups[d] for d in sorted(groups, key=str)]


def _dims(tree, dims):
    leaves, treedef = jax.tree.flatten(tree)
    per_leaf = [dims] * len(leaves) if isinstance(dims, int) else treedef.flatten_up_to(dims)
    return leaves, treedef, [d % max(jnp.ndim(x), 1) for x, d in zip(leaves, per_leaf)]


def ring_reduce_scatter(tree, axis_name: str = DATA_AXIS, dims=0):
    """Sum ``tree`` over ``axis_name`` and keep this device's block of dimension ``dims`` of each leaf.

    ``dims``: an int for every leaf, or a tree of ints like ``tree``. Equals
    ``lax.psum_scatter(x, axis_name, scatter_dimension=d, tiled=True)`` per
    leaf; each leaf's dimension d must divide by the axis size.
    """
    n = lax.axis_size(axis_name)
    leaves, treedef, dims = _dims(tree, dims)
    if n == 1 or not leaves:
        return tree
    out = list(leaves)
    for members in _by_dtype(leaves):
        rows = [jnp.moveaxis(leaves[i], dims[i], 0).reshape(n, -1) for i in members]
        mine = _reduce_scatter_rows(jnp.concatenate(rows, axis=1), axis_name)
        offset = 0
        for i, r in zip(members, rows):
            moved = jnp.moveaxis(leaves[i], dims[i], 0)
            block = mine[offset : offset + r.shape[1]].reshape(moved.shape[0] // n, *moved.shape[1:])
            out[i] = jnp.moveaxis(block, 0, dims[i])
            offset += r.shape[1]
    return jax.tree.unflatten(treedef, out)


def ring_all_gather(tree, axis_name: str = DATA_AXIS, dims=0):
    """Concatenate every device's ``tree`` along dimension ``dims`` of each leaf, in device order.

    Equals ``lax.all_gather(x, axis_name, axis=d, tiled=True)`` per leaf.
    """
    n = lax.axis_size(axis_name)
    leaves, treedef, dims = _dims(tree, dims)
    if n == 1 or not leaves:
        return tree
    out = list(leaves)
    for members in _by_dtype(leaves):
        moved = [jnp.moveaxis(leaves[i], dims[i], 0) for i in members]
        everyone = _all_gather_rows(jnp.concatenate([m.reshape(-1) for m in moved]), axis_name, n)
        offset = 0
        for i, m in zip(members, moved):
            block = everyone[:, offset : offset + m.size].reshape(n * m.shape[0], *m.shape[1:])
            out[i] = jnp.moveaxis(block, 0, dims[i])
            offset += m.size
    return jax.tree.unflatten(treedef, out)


def ring_allreduce(tree, axis_name: str = DATA_AXIS):
    """Sum ``tree`` over ``axis_name`` with a ring: reduce-scatter, then all-gather (equals ``lax.psum``).

    Each dtype's leaves are packed into one flat buffer, padded to a multiple
    of n and cut into n rows, so any leaf shape works.
    """
    n = lax.axis_size(axis_name)
    leaves, treedef = jax.tree.flatten(tree)
    if n == 1 or not leaves:
        return tree
    out = list(leaves)
    for members in _by_dtype(leaves):
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in members])
        chunk = math.ceil(flat.size / n)
        buf = jnp.pad(flat, (0, chunk * n - flat.size)).reshape(n, chunk)
        total = _all_gather_rows(_reduce_scatter_rows(buf, axis_name), axis_name, n).reshape(-1)
        offset = 0
        for i in members:
            size = math.prod(jnp.shape(leaves[i]))
            out[i] = total[offset : offset + size].reshape(jnp.shape(leaves[i]))
            offset += size
    return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class Comm:
    """How a per-device function talks to the other devices along the batch axes (``"data"``; a hybrid mesh's
    ``("replica", "data")``)."""

    mean: Callable  # pytree -> its mean over devices
    sum: Callable  # pytree -> its sum over devices
    vary: Callable  # mark replicated values per-device (so gradients stay local)
    gather: Callable  # params (FSDP leaves: local shards) -> whole params, per-device
    gather_like: Callable  # (tree, dims) -> the tree with its leaves that have a data dimension gathered whole
    scatter_mean: Callable  # gradients of whole params -> their mean, FSDP leaves as the local shard


def _pcast(tree, axes=DATA_AXIS):
    return jax.tree.map(lambda x: lax.pcast(x, axes, to="varying"), tree)


def _by_dim(tree, dims, sharded: Callable, replicated: Callable):
    """Apply ``sharded(leaves, dims)`` to the leaves with a data dimension, ``replicated(leaves)`` to the rest."""
    leaves, treedef = jax.tree.flatten(tree)
    per_leaf = treedef.flatten_up_to(dims)
    out = list(leaves)
    split = [i for i, d in enumerate(per_leaf) if d is not None]
    whole = [i for i, d in enumerate(per_leaf) if d is None]
    if split:
        for i, x in zip(split, sharded([leaves[i] for i in split], [per_leaf[i] for i in split])):
            out[i] = x
    if whole:
        for i, x in zip(whole, replicated([leaves[i] for i in whole])):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def make_comm(dims, ring: bool = False, grad_dims=None, batch=DATA_AXIS, shard=DATA_AXIS) -> Comm:
    """``lax`` (or ring) collectives over the batch axes ``batch``; ``dims``: per parameter, its FSDP dimension
    or None; ``grad_dims``: the same for the gradients the update gets, where they differ (ZeRO-1: params whole,
    gradients reduce-scattered); ``shard``: the axes FSDP leaves are split over. HSDP (``shard`` "data" of
    ``batch`` ("replica", "data")): gradients reduce-scattered within a process, then all-reduced across."""
    across = tuple(a for a in axes_of(batch) if a not in axes_of(shard))
    if ring and batch != DATA_AXIS:
        raise ConfigError("the ring runs over one axis: a hybrid mesh ('replica') needs "
                          f"{named('strategy', repr('shard_map'))}, 'jit' or 'explicit'")
    if ring:
        def total(t):
            return ring_allreduce(t, DATA_AXIS)

        def gather_split(xs, ds):
            return ring_all_gather(xs, DATA_AXIS, ds)

        def scatter_split(xs, ds):
            return ring_reduce_scatter(xs, DATA_AXIS, ds)
    else:
        def total(t):
            return lax.psum(t, batch)

        def gather_split(xs, ds):  # HSDP: marked varying across too, so the gradient is summed across once (below)
            whole = [lax.all_gather(x, shard, axis=d, tiled=True) for x, d in zip(xs, ds)]
            return _pcast(whole, across) if across else whole

        def scatter_split(xs, ds):  # within (shard), then across the rest of the batch axes (HSDP) on the shards
            mine = [lax.psum_scatter(x, shard, scatter_dimension=d, tiled=True) for x, d in zip(xs, ds)]
            return lax.psum(mine, across) if across else mine

    def vary(t):
        return _pcast(t, batch)

    def mean(tree):
        n = lax.axis_size(batch)
        return jax.tree.map(lambda x: x / n, total(tree))

    def scatter_mean(grads):
        n = lax.axis_size(batch)
        return jax.tree.map(lambda g: g / n, _by_dim(grads, dims if grad_dims is None else grad_dims, scatter_split,
                                                     total))

    return Comm(mean=mean, sum=total, vary=vary, gather=lambda p: _by_dim(p, dims, gather_split, vary),
                gather_like=lambda t, d: _by_dim(t, d, gather_split, lambda xs: xs), scatter_mean=scatter_mean)
