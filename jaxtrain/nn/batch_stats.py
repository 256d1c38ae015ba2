"""BatchNorm's statistics over a train step's whole batch: one collective in the forward, none in their backward.

``moments(x, axes)``: the mean and the (biased) variance of ``x`` over ``axes``, over every device's examples
where a train step splits the batch, the model not knowing how (``jaxtrain.core.context.step_context``):

- inside ``shard_map`` / ``pmap`` (``axis_name``: the step's ``batch_axis``): each device's two-pass mean and
  variance, every device's gathered by ONE ``psum`` (each in its own row of zeros: exact) and combined as
  Chan et al. combine them (the mean of the variances plus the variance of the means; every device holds
  as many examples). As stable as two passes over the whole batch;
- under ``jit`` / ``explicit`` with the batch split over the mesh: the same, in a ``shard_map`` over the
  batch's axes (other axes stay with the partitioner);
- elsewhere (one device, no train step): two passes over ``x``.

``split`` says where BatchNorm takes them (``jaxtrain.models.resnet.BatchNorm``; flax's own statistics
elsewhere): the batch split over at most ``MAX_DEVICES`` devices.

The backward is elementwise, ``dx = (dmean + 2 dvar (x - mean)) / N``: the only reduction left in a
BatchNorm's backward is the normalisation's own (one all-reduce, XLA combining its two sums). flax's
synchronised BatchNorm (two-pass) takes two all-reduces each way; on XLA:CPU every one is a rendezvous of
the devices. Taking one instead of two halves a ResNet's all-reduces per step (docs/performance.md,
"BatchNorm's collectives", has the counts and the time).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.core.compat import varying_axes


def _two_pass(x, axes):
    mean = x.mean(axes)
    return mean, jnp.square(x - jnp.expand_dims(mean, axes)).mean(axes)


def _over(axis, x, axes):
    """Inside ``shard_map`` over ``axis``: (mean, variance) over every device's ``x``, invariant over ``axis``."""
    local = jnp.stack(_two_pass(x, axes))
    rows = jnp.zeros((lax.psum(1, axis), *local.shape), local.dtype)
    means, variances = jnp.moveaxis(lax.psum(rows.at[lax.axis_index(axis)].set(local), axis), 1, 0)
    mean = means.mean(0)
    return mean, variances.mean(0) + jnp.square(means - mean).mean(0)


def _split(x, axes) -> tuple[str, ...]:
    """Under ``jit``/``explicit`` in a train step: the mesh axes the batch (dim 0, reduced over) is split over,
    where it is split (more than one device, evenly); else ()."""
    from jaxtrain.core.context import step_context
    from jaxtrain.parallel.devices import batch_axes
    from jaxtrain.parallel.sharding import axes_of

    ctx = step_context()
    if ctx is None or ctx.batch_axis is not None or 0 not in axes or jax.sharding.get_abstract_mesh().manual_axes:
        return ()
    split = axes_of(batch_axes(ctx.mesh))
    size = math.prod(ctx.mesh.shape[a] for a in split)
    return split if size > 1 and x.shape[0] % size == 0 else ()


# The gathered rows are devices x 2 x channels floats per layer: on 8 devices ResNet-50's are 1.6 MiB a step, on
# 1,024 they would be 208 MiB, more than its fp32 gradients (98 MiB), for 106 all-reduces saved. Beyond this
# many devices BatchNorm keeps flax's statistics (two all-reduces of 2 x channels each way).
MAX_DEVICES = 256


def split(x, axes, axis_name=None) -> bool:
    """Whether BatchNorm should take ``moments`` here: they combine several devices' shares (inside
    ``shard_map``/``pmap``: ``axis_name``; under ``jit``: the step's batch split over the mesh), over at most
    ``MAX_DEVICES``."""
    from jaxtrain.core.context import step_context

    if axis_name is not None:
        return lax.psum(1, axis_name) <= MAX_DEVICES
    split_axes = _split(x, tuple(axes))
    return bool(split_axes) and math.prod(step_context().mesh.shape[a] for a in split_axes) <= MAX_DEVICES


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _moments(x, axes, axis):
    return _forward(x, axes, axis)[0]


def _forward(x, axes, axis):
    from jaxtrain.core.context import step_context

    if axis is not None:  # inside shard_map / pmap: x is this device's share
        stats = _over(axis, x, axes)
    elif split := _split(x, axes):
        mesh = jax.sharding.get_abstract_mesh()  # explicit: the mesh as typed where this is traced
        spec = P(split if len(split) > 1 else split[0])
        stats = jax.shard_map(functools.partial(_over, split, axes=axes),
                              mesh=mesh if mesh.axis_names else step_context().mesh, in_specs=spec,
                              out_specs=(P(), P()), axis_names=frozenset(split))(x)
    else:
        stats = _two_pass(x, axes)
    return stats, (x, stats[0])


def _backward(axes, axis, res, cotangents):
    x, mean = res
    dmean, dvar = cotangents
    count = (lax.psum(1, axis) if axis is not None else 1) * math.prod(x.shape[a] for a in axes)  # every device's
    if axis is not None and not varying_axes(x):  # shard_map unchecked (ring): each device's share of the cotangents
        dmean, dvar = lax.psum(jnp.stack((dmean, dvar)), axis)
    expand = functools.partial(jnp.expand_dims, axis=axes)
    return ((expand(dmean) + 2 * expand(dvar) * (x - expand(mean))) / count,)


_moments.defvjp(_forward, _backward)


def moments(x: jax.Array, axes, axis_name=None) -> tuple[jax.Array, jax.Array]:
    """(mean, variance) of ``x`` over ``axes`` and over the devices the train step splits the batch over:
    ``axis_name`` inside ``shard_map``/``pmap`` (a BatchNorm's, set by ``jt.from_nnx``); else found from the
    step (``jit``, ``explicit``), if any."""
    return _moments(x, tuple(axes), axis_name)
