"""oneDNN's convolution calls as a JAX program sees them (``jaxtrain.kernels.onednn`` builds and registers them).

Three FFI calls, on whatever shapes they are given (a device's share, under a partitioner):

- ``forward(x, w) -> y``;
- ``forward_save(x, w) -> (y, saved)``: also ``x`` in the layout oneDNN's backward-weights kernel reads,
  ``[B, floats]`` (where that layout keeps each example contiguous), sparing the backward a reorder;
- ``backward(dy, w, saved) -> (dx, dw)``: ``saved`` is that, or ``x`` itself as ``[B, H*W*C]``.

``conv`` is the convolution with its VJP over them, under every strategy: under ``jit`` each call is a
``custom_partitioning`` that keeps the batch split (results too) and sums ``dw`` over the batch's mesh axes;
inside ``shard_map`` (``ring``, ``pmap``) each device's call is its own, typed varying and summed as JAX's
autodiff of ``lax``'s conv would; under the explicit strategy the backward runs in a ``shard_map`` over the
step's batch axes (``_explicit_batch_axes``).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import settings
from jaxtrain.core.compat import varying_axes
from jaxtrain.kernels.onednn_build import note
from jaxtrain.parallel import hosts


def out_shape(x_shape, w_shape, geometry):
    (b, h, w, _), (kh, kw, _, co), (strides, pads) = x_shape, w_shape, geometry
    return b, (h + sum(pads[0]) - kh) // strides[0] + 1, (w + sum(pads[1]) - kw) // strides[1] + 1, co


THREADS = settings.VARIABLES["onednn_threads"]


def threads() -> int:
    """OpenMP threads per call: the host's cores over the devices that run at once on it (virtual CPU devices
    share them; so do the processes on one host, however they were launched: ``hosts``). Numbers depend on it
    (oneDNN splits its reductions over its threads): 2 processes x 1 device and 1 process x 2 devices get the
    same count, and the same parameters bit for bit. ``$JAXTRAIN_ONEDNN_THREADS`` (``settings.onednn_threads``:
    1 to the cores this process may run on) when set; more than the cores over the devices at once is taken,
    with one warning line (the calls then oversubscribe the cores)."""
    share = hosts.current()
    cores, devices = share.cores, share.devices
    fair = max(1, cores // devices)
    wanted = settings.current().onednn_threads
    if wanted is None:
        return fair
    if wanted > fair:
        _warn_oversubscribed(wanted, devices, cores)
    return wanted


@functools.cache
def _warn_oversubscribed(n: int, devices: int, cores: int) -> None:
    note(f"{THREADS}={n} x {devices} device(s) at once = {n * devices} threads on {cores} cores: the calls "
         f"oversubscribe the cores (slower); unset it for {max(1, cores // devices)} per call")


def _attrs(geometry, **more):
    strides, ((pt, pb), (pl, pr)) = geometry
    return dict(sh=strides[0], sw=strides[1], pt=pt, pb=pb, pl=pl, pr=pr, threads=threads(),
                always_blocked=int(settings.current().onednn_blocked), **more)


def _ffi_forward(x, w, geometry):
    y = jax.ShapeDtypeStruct(out_shape(x.shape, w.shape, geometry), x.dtype)
    return jax.ffi.ffi_call("JaxtrainDnnlConvFwd", y)(x, w, **_attrs(geometry))


def _ffi_forward_save(x, w, geometry, floats):
    shapes = (jax.ShapeDtypeStruct(out_shape(x.shape, w.shape, geometry), x.dtype),
              jax.ShapeDtypeStruct((x.shape[0], floats), x.dtype))
    return jax.ffi.ffi_call("JaxtrainDnnlConvFwdSave", shapes)(x, w, **_attrs(geometry))


def _ffi_backward(dy, w, saved, geometry, x_hwc, blocked):
    shapes = (jax.ShapeDtypeStruct((dy.shape[0], *x_hwc), dy.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
    return jax.ffi.ffi_call("JaxtrainDnnlConvBwd", shapes)(dy, w, saved, **_attrs(geometry, blocked=int(blocked)))


# --- under jit: each call partitioned along the batch ---

def _batch_spec(sharding, lead: int = 1) -> tuple:
    spec = tuple(getattr(sharding, "spec", P()))
    return (spec + (None,) * lead)[:lead]


def partitioned(call, n_arrays, rule, whole, split_args, split_results, summed=(), lead=1):
    """``call(*arrays, *static)`` as a ``custom_partitioning``: the arguments at ``split_args`` and the results
    at ``split_results`` split along their first ``lead`` dims as the first argument is, the rest whole on every
    device; the results at ``summed`` (each device's share's) summed over the batch's axes (``lead`` 1).
    ``rule``: Shardy's, with every factor but the leading ones in ``whole`` (in the order of first use)."""

    def shardings(mesh, first, shapes, splits):
        split_as = _batch_spec(first.sharding, lead)
        return tuple(NamedSharding(mesh, P(*split_as, *(None,) * (len(s.shape) - lead)) if split else P())
                     for s, split in zip(shapes, splits)), split_as[0]

    def partition(*args):
        *static, mesh, arg_shapes, result_shape = args
        results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        arg_sh, axes = shardings(mesh, arg_shapes[0], arg_shapes, split_args)
        out_sh, _ = shardings(mesh, arg_shapes[0], results, split_results)

        def lower(*arrays):
            out = call(*arrays, *static)
            many = isinstance(out, tuple)
            out = tuple(lax.psum(o, axes) if i in summed and axes else o for i, o in enumerate(out if many else (out,)))
            return out if many else out[0]

        return mesh, lower, (out_sh if len(results) > 1 else out_sh[0]), arg_sh

    def infer(*args):
        *_, mesh, arg_shapes, result_shape = args
        results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        out_sh, _ = shardings(mesh, arg_shapes[0], results, split_results)
        return out_sh if len(results) > 1 else out_sh[0]

    fn = custom_partitioning(call, static_argnums=tuple(range(n_arrays, call.__code__.co_argcount)))
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=whole)
    return fn


_forward_split = partitioned(_ffi_forward, 2, "b h w c, i j c o -> b p q o", tuple("hwcijopq"),
                              (True, False), (True,))
_forward_save_split = partitioned(_ffi_forward_save, 2, "b h w c, i j c o -> b p q o, b k", tuple("hwcijopqk"),
                                   (True, False), (True, True))
_backward_split = partitioned(_ffi_backward, 3, "b p q o, i j c o, b k -> b h w c, i j c o", tuple("pqoijckhw"),
                               (True, False, True), (True, False), summed=(1,))


# --- inside shard_map / pmap: each device's own call ---

def as_varying(y, axes):
    missing = tuple(sorted(set(axes) - varying_axes(y)))  # an FFI call's result may already vary as its operands
    return lax.pcast(y, missing, to="varying") if missing else y


def cotangent(g, primal, source):
    """A device's ``g`` typed as computed from ``source``, summed over the axes ``source`` varies over and
    ``primal`` does not (it was broadcast to the devices), as JAX's autodiff of ``lax``'s conv does."""
    g, summed = as_varying(g, varying_axes(source)), varying_axes(source) - varying_axes(primal)
    return lax.psum(g, tuple(sorted(summed))) if summed else g


def manual() -> bool:
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def _explicit_batch_axes() -> tuple[str, ...]:
    """The batch's mesh axes where a train step is traced under a mesh context (the explicit strategy's
    ``auto_axes``); else (). There, on jax 0.12, the psum in ``_backward_split``'s per-device program keeps a
    Shardy annotation XLA:CPU cannot run ("Unsupported reduction computation"): a shard_map instead."""
    from jaxtrain.core.context import step_context
    from jaxtrain.parallel.devices import batch_axes

    ctx = step_context()
    if ctx is None or not jax.sharding.get_abstract_mesh().axis_names:
        return ()
    axes = batch_axes(ctx.mesh)
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _forward(x, w, geometry, floats):
    """(y, the residual for the backward): x saved in oneDNN's layout where ``floats``, else x itself."""
    if manual():
        vary = varying_axes(x) | varying_axes(w)
        if floats:
            y, saved = _ffi_forward_save(x, w, geometry, floats)
            return as_varying(y, vary), as_varying(saved, vary)
        return as_varying(_ffi_forward(x, w, geometry), vary), x.reshape(x.shape[0], -1)
    if floats:
        return _forward_save_split(x, w, geometry, floats)
    return _forward_split(x, w, geometry), x.reshape(x.shape[0], -1)


def _backward(dy, w, saved, geometry, x_hwc, blocked):
    if manual():
        dx, dw = _ffi_backward(dy, w, saved, geometry, x_hwc, blocked)
        return cotangent(dx, saved, dy), cotangent(dw, w, dy)
    if axes := _explicit_batch_axes():
        split = P(axes)
        return jax.shard_map(functools.partial(_backward, geometry=geometry, x_hwc=x_hwc, blocked=blocked),
                             mesh=jax.sharding.get_abstract_mesh(), in_specs=(split, P(), split),
                             out_specs=(split, P()), axis_names=frozenset(axes))(dy, w, saved)
    return _backward_split(dy, w, saved, geometry, x_hwc, blocked)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def conv(x, w, geometry, x_hwc, floats):
    """y = x (*) w for ``geometry`` ((strides), (pads)), NHWC / HWIO f32 (``x_hwc``: x's H, W, C); ``floats``: per
    example, the backward-weights layout's size where the forward can save x in it (0: the backward reads x)."""
    if manual():
        return as_varying(_ffi_forward(x, w, geometry), varying_axes(x) | varying_axes(w))
    return _forward_split(x, w, geometry)


def _conv_fwd(x, w, geometry, x_hwc, floats):
    y, saved = _forward(x, w, geometry, floats)
    return y, (saved, w)


def _conv_bwd(geometry, x_hwc, floats, res, dy):
    saved, w = res
    return _backward(dy, w, saved, geometry, x_hwc, bool(floats))


conv.defvjp(_conv_fwd, _conv_bwd)
