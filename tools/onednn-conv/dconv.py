"""oneDNN convolutions (conv.cc, built by build.sh) as a drop-in ``lax.conv_general_dilated`` for NHWC / HWIO
2-D convolutions on CPU, with a custom VJP (backward-data and backward-weights are oneDNN's too). A prototype."""

import ctypes
import functools
import os
from pathlib import Path

import jax
import numpy as np
from jax import lax

_lib = ctypes.cdll.LoadLibrary(str(Path(__file__).with_name("libconv.so")))
for name in ("DnnlConvFwd", "DnnlConvBwdData", "DnnlConvBwdWeights", "DnnlConvFwdSave", "DnnlConvBwd"):
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(_lib, name)), platform="cpu")


def _attrs(strides, pads):
    (pt, pb), (pl, pr) = pads
    return dict(
        sh=np.int64(strides[0]),
        sw=np.int64(strides[1]),
        pt=np.int64(pt),
        pb=np.int64(pb),
        pl=np.int64(pl),
        pr=np.int64(pr),
    )


def _varying(x) -> frozenset:
    """The manual (shard_map) axes ``x`` varies over: empty outside shard_map."""
    t = jax.typeof(x)
    return frozenset(getattr(t, "vma", None) or getattr(getattr(t, "manual_axis_type", None), "varying", ()))


def _as_varying(y, axes):
    """A custom call's result typed as varying over ``axes`` (each device computed its own share)."""
    return lax.pcast(y, tuple(sorted(axes)), to="varying") if axes else y


def _weight_grad(dw, dy, w):
    """Each device's dw is its share's: summed over the axes the batch varies over and the weight does not."""
    dw = _as_varying(dw, _varying(dy))
    extra = _varying(dy) - _varying(w)
    return lax.psum(dw, tuple(sorted(extra))) if extra else dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dconv(x, w, strides, pads):
    return _fwd(x, w, strides, pads)


def _fwd(x, w, strides, pads):
    B, H, W, C = x.shape
    kh, kw, ci, co = w.shape
    Ho = (H + pads[0][0] + pads[0][1] - kh) // strides[0] + 1
    Wo = (W + pads[1][0] + pads[1][1] - kw) // strides[1] + 1
    y = jax.ffi.ffi_call("DnnlConvFwd", jax.ShapeDtypeStruct((B, Ho, Wo, co), x.dtype))(x, w, **_attrs(strides, pads))
    return _as_varying(y, _varying(x) | _varying(w))


_lib.dnnl_residual_floats.restype = ctypes.c_int64
_lib.dnnl_residual_floats.argtypes = [ctypes.c_int64] * 15
SEPARATE = bool(os.environ.get("DNNL_SEPARATE"))  # 3 calls, each reordering its own inputs (the first version)


def _out_shape(x, w, strides, pads):
    (B, H, W, _), (kh, kw, _, co) = x.shape, w.shape
    return (B, (H + sum(pads[0]) - kh) // strides[0] + 1, (W + sum(pads[1]) - kw) // strides[1] + 1, co)


def _vjp_fwd(x, w, strides, pads):
    if SEPARATE:
        return _fwd(x, w, strides, pads), (x, w)
    y = _out_shape(x, w, strides, pads)
    n = _lib.dnnl_residual_floats(
        *x.shape, w.shape[0], w.shape[1], w.shape[3], y[1], y[2], *strides, *pads[0], *pads[1]
    )
    y, saved = jax.ffi.ffi_call(
        "DnnlConvFwdSave", (jax.ShapeDtypeStruct(y, x.dtype), jax.ShapeDtypeStruct((n,), x.dtype))
    )(x, w, **_attrs(strides, pads))
    return _as_varying(y, _varying(x) | _varying(w)), (x.shape, w, saved)


def _vjp_bwd(strides, pads, res, dy):
    a = _attrs(strides, pads)
    if SEPARATE:
        x, w = res
        dx = jax.ffi.ffi_call("DnnlConvBwdData", jax.ShapeDtypeStruct(x.shape, x.dtype))(dy, w, **a)
        dw = jax.ffi.ffi_call("DnnlConvBwdWeights", jax.ShapeDtypeStruct(w.shape, w.dtype))(x, dy, **a)
        return _as_varying(dx, _varying(x)), _weight_grad(dw, dy, w)
    x_shape, w, saved = res
    dx, dw = jax.ffi.ffi_call(
        "DnnlConvBwd", (jax.ShapeDtypeStruct(x_shape, dy.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
    )(dy, w, saved, **a)
    return _as_varying(dx, _varying(dy)), _weight_grad(dw, dy, w)  # x varies as dy does (w over no more axes)


dconv.defvjp(_vjp_fwd, _vjp_bwd)


def conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
    **kw,
):
    assert (
        feature_group_count == 1
        and (lhs_dilation is None or set(lhs_dilation) == {1})
        and (rhs_dilation is None or set(rhs_dilation) == {1})
    )
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
    return dconv(lhs, rhs, tuple(window_strides), tuple(tuple(p) for p in padding))
