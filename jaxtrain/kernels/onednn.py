"""oneDNN's convolutions on CPU (through the XLA FFI): a drop-in ``lax.conv_general_dilated``.

XLA:CPU's convolutions are Eigen's, which need the batch as the minor axis for a weight gradient and a flipped,
transposed kernel for an input gradient: ResNet-18's step spent ~127 ms of ~1,260 in those relayouts
(docs/performance.md, "ResNet-18 on this CPU"). oneDNN (PyTorch's CPU backend) has native backward kernels.
``conv_general_dilated`` sends f32 2-D NHWC / HWIO convolutions on CPU to ``onednn_conv.cc`` (forward; input
and weight gradients in one backward call) and everything else to XLA's own, so a model that takes it runs
unchanged on a GPU (``lax.platform_dependent``: GPU lowering never sees the CPU call) and under every strategy:

- under ``jit`` (GSPMD / Shardy): ``custom_partitioning`` keeps the batch split and replicates the rest, each
  device convolving its share; the weight gradient is summed over the batch's mesh axes;
- inside ``shard_map`` (and ``pmap``): each device's call is its own, typed varying as ``lax``'s conv would be,
  the weight gradient summed over the axes the batch varies over and the weights do not (as JAX's autodiff does).

The library is compiled on first use (g++ with oneDNN's headers: Debian's ``libdnnl-dev``; ~5 s) into
``$JAXTRAIN_ONEDNN_CACHE`` (default ``~/.cache/jaxtrain/onednn``), one file per source and jaxlib;
``python -m jaxtrain.kernels.onednn`` builds it and says whether it is usable. Without a compiler or oneDNN,
``available()`` is False and ``reason()`` says why: ``conv="auto"`` then keeps XLA's convolutions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SOURCE = Path(__file__).with_name("onednn_conv.cc")
_TARGETS = ("JaxtrainDnnlConvFwd", "JaxtrainDnnlConvBwd")
_NHWC = lax.ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))
INSTALL = "install a C++ compiler and oneDNN's headers (Debian: apt-get install g++ libdnnl-dev)"


def cache_dir() -> Path:
    return Path(os.environ.get("JAXTRAIN_ONEDNN_CACHE") or Path.home() / ".cache" / "jaxtrain" / "onednn")


def build() -> Path:
    """The compiled library (built now if this source and jaxlib have none yet); OSError: why it cannot be."""
    from jaxtrain.dirlock import DirLock

    include = jax.ffi.include_dir()
    key = hashlib.sha256(SOURCE.read_bytes() + f"{jax.__version__} {include}".encode()).hexdigest()[:16]
    lib = cache_dir() / f"conv-{key}.so"
    if lib.exists():
        return lib
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise OSError(f"no C++ compiler found: {INSTALL}")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with DirLock(lib.parent, "JAXTRAIN_ONEDNN_CACHE", name=".build.lock", waiting="waiting for another build"):
        if lib.exists():
            return lib
        tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{include}", str(SOURCE), "-ldnnl",
               "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise OSError(f"building the oneDNN convolutions failed ({(errors or ['?'])[0].strip()}): {INSTALL}")
        os.replace(tmp, lib)  # whole or absent: a build cut short leaves no half-written library
    return lib


@functools.cache
def reason() -> str | None:
    """None when the oneDNN convolutions are usable here; else why not (one line)."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    for name in _TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    return None


def available() -> bool:
    return reason() is None


def supported(lhs, rhs, dimension_numbers=None, lhs_dilation=None, rhs_dilation=None, feature_group_count=1,
              batch_group_count=1, preferred_element_type=None) -> bool:
    """Whether oneDNN takes this convolution: 2-D, f32, NHWC / HWIO, no dilation, no groups."""
    if lhs.ndim != 4 or rhs.ndim != 4 or lhs.dtype != jnp.float32 or rhs.dtype != jnp.float32:
        return False
    if lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) != _NHWC:
        return False
    ones = lambda d: d is None or all(v == 1 for v in d)  # noqa: E731
    return (ones(lhs_dilation) and ones(rhs_dilation) and feature_group_count == 1 and batch_group_count == 1
            and preferred_element_type in (None, jnp.float32))


def choose(conv: str):
    """(name, fn) of the convolution ``conv`` names: "xla" (``lax``'s), "onednn" (a ConfigError where it is not
    usable), or "auto": oneDNN's on a CPU backend where it is usable, else XLA's."""
    from jaxtrain.choices import CONVS
    from jaxtrain.errors import ConfigError

    if conv not in CONVS:
        raise ConfigError(f"unknown conv {conv!r}: choose one of {', '.join(CONVS)}")
    if conv == "onednn" and not available():
        raise ConfigError(f"conv=onednn: {reason()}; or use conv=xla")
    if conv == "onednn" or (conv == "auto" and jax.default_backend() == "cpu" and available()):
        return "onednn", conv_general_dilated
    return "xla", lax.conv_general_dilated


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None, out_sharding=None):
    """``lax.conv_general_dilated``: oneDNN's on CPU where ``supported`` (and the library ``available``),
    XLA's everywhere else (other platforms, dtypes, layouts, an ``out_sharding`` asked for)."""
    options = dict(lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                   feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                   preferred_element_type=preferred_element_type)
    xla = lambda x, w: lax.conv_general_dilated(x, w, window_strides, padding, precision=precision,  # noqa: E731
                                                out_sharding=out_sharding, **options)
    if out_sharding is not None or not supported(lhs, rhs, **options) or not available():
        return xla(lhs, rhs)
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
    strides, pads = tuple(int(s) for s in window_strides), tuple(tuple(int(p) for p in pair) for pair in padding)
    return lax.platform_dependent(lhs, rhs, cpu=lambda x, w: _conv(x, w, strides, pads), default=xla)


# --- the FFI calls, on whatever shapes they are given (a device's share under a partitioner) ---

def _geometry(strides, pads):
    (pt, pb), (pl, pr) = pads
    return dict(sh=strides[0], sw=strides[1], pt=pt, pb=pb, pl=pl, pr=pr)


def _out_shape(x_shape, w_shape, strides, pads):
    (b, h, w, _), (kh, kw, _, co) = x_shape, w_shape
    return b, (h + sum(pads[0]) - kh) // strides[0] + 1, (w + sum(pads[1]) - kw) // strides[1] + 1, co


def _ffi_forward(x, w, strides, pads):
    y = jax.ShapeDtypeStruct(_out_shape(x.shape, w.shape, strides, pads), x.dtype)
    return jax.ffi.ffi_call("JaxtrainDnnlConvFwd", y)(x, w, **_geometry(strides, pads))


def _ffi_backward(dy, w, x, strides, pads):
    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
    return jax.ffi.ffi_call("JaxtrainDnnlConvBwd", shapes)(dy, w, x, **_geometry(strides, pads))


# --- under jit: partitioned along the batch ---

def _batch_split(mesh, sharding, rank=4):
    """``sharding``'s split of dim 0, every other dim whole."""
    spec = getattr(sharding, "spec", P())
    return NamedSharding(mesh, P(spec[0] if len(spec) else None, *(None,) * (rank - 1)))


def _fwd_partition(strides, pads, mesh, arg_shapes, result_shape):
    split = _batch_split(mesh, arg_shapes[0].sharding)
    lower = functools.partial(_ffi_forward, strides=strides, pads=pads)
    return mesh, lower, split, (split, NamedSharding(mesh, P()))


def _bwd_partition(strides, pads, mesh, arg_shapes, result_shape):
    split = _batch_split(mesh, arg_shapes[2].sharding)  # x's split; dy (same batch) is made to follow it
    axes = split.spec[0]

    def lower(dy, w, x):
        dx, dw = _ffi_backward(dy, w, x, strides, pads)
        return dx, (lax.psum(dw, axes) if axes else dw)  # each device's dw is its share's

    return mesh, lower, (split, NamedSharding(mesh, P())), (split, NamedSharding(mesh, P()), split)


# Every factor but the batch stays whole on each device (listed in the order of first use: Shardy wants it).
_FWD_RULE, _FWD_WHOLE = "b h w c, i j c o -> b p q o", ("h", "w", "c", "i", "j", "o", "p", "q")
_BWD_RULE, _BWD_WHOLE = "b p q o, i j c o, b h w c -> b h w c, i j c o", ("p", "q", "o", "i", "j", "c", "h", "w")


@functools.partial(custom_partitioning, static_argnums=(2, 3))
def _forward_split(x, w, strides, pads):
    return _ffi_forward(x, w, strides, pads)


_forward_split.def_partition(
    partition=_fwd_partition,
    infer_sharding_from_operands=lambda strides, pads, mesh, args, result: _batch_split(mesh, args[0].sharding),
    sharding_rule=_FWD_RULE, need_replication_factors=_FWD_WHOLE)


@functools.partial(custom_partitioning, static_argnums=(3, 4))
def _backward_split(dy, w, x, strides, pads):
    return _ffi_backward(dy, w, x, strides, pads)


_backward_split.def_partition(
    partition=_bwd_partition,
    infer_sharding_from_operands=lambda strides, pads, mesh, args, result: (
        _batch_split(mesh, args[2].sharding), NamedSharding(mesh, P())),
    sharding_rule=_BWD_RULE, need_replication_factors=_BWD_WHOLE)


# --- inside shard_map / pmap: each device's own call ---

def _varying(x) -> frozenset:
    """The manual axes ``x`` varies over (jax 0.10: ``.manual_axis_type.varying``; later: ``.vma``)."""
    t = jax.typeof(x)
    return frozenset(getattr(t, "vma", None) or getattr(getattr(t, "manual_axis_type", None), "varying", ()))


def _as_varying(y, axes):
    return lax.pcast(y, tuple(sorted(axes)), to="varying") if axes else y


def _manual() -> bool:
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def _forward(x, w, strides, pads):
    if _manual():
        return _as_varying(_ffi_forward(x, w, strides, pads), _varying(x) | _varying(w))
    return _forward_split(x, w, strides, pads)


def _cotangent(g, primal, source):
    """A device's ``g`` typed as computed from ``source``, summed over the axes ``source`` varies over and
    ``primal`` does not (it was broadcast to the devices), as JAX's autodiff of ``lax``'s conv does."""
    g, summed = _as_varying(g, _varying(source)), _varying(source) - _varying(primal)
    return lax.psum(g, tuple(sorted(summed))) if summed else g


def _backward(dy, w, x, strides, pads):
    if _manual():
        dx, dw = _ffi_backward(dy, w, x, strides, pads)
        return _cotangent(dx, x, dy), _cotangent(dw, w, dy)
    axes = _explicit_batch_axes()
    if axes:  # the explicit strategy: its batch axes in a shard_map of this call (see _explicit_batch_axes)
        split = P(axes)
        return jax.shard_map(functools.partial(_backward, strides=strides, pads=pads),
                             mesh=jax.sharding.get_abstract_mesh(), in_specs=(split, P(), split),
                             out_specs=(split, P()), axis_names=frozenset(axes))(dy, w, x)
    return _backward_split(dy, w, x, strides, pads)


def _explicit_batch_axes() -> tuple[str, ...]:
    """The batch's mesh axes where a train step is traced under a mesh context (the explicit strategy's
    ``auto_axes``); else (). There, on jax 0.12, the psum in ``_backward_split``'s per-device program keeps a
    Shardy annotation XLA:CPU cannot run ("Unsupported reduction computation"): a shard_map instead."""
    from jaxtrain.devices import batch_axes
    from jaxtrain.step import step_context

    ctx = step_context()
    if ctx is None or not jax.sharding.get_abstract_mesh().axis_names:
        return ()
    axes = batch_axes(ctx.mesh)
    return (axes,) if isinstance(axes, str) else tuple(axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x, w, strides, pads):
    return _forward(x, w, strides, pads)


_conv.defvjp(lambda x, w, strides, pads: (_forward(x, w, strides, pads), (x, w)),
             lambda strides, pads, res, dy: _backward(dy, res[1], res[0], strides, pads))


if __name__ == "__main__":
    import sys

    why = reason()
    print(f"oneDNN convolutions: {'not usable: ' + why if why else 'usable (' + str(build()) + ')'}")
    sys.exit(0)
