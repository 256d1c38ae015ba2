"""oneDNN's convolutions on CPU (through the XLA FFI): a drop-in ``lax.conv_general_dilated``.

XLA:CPU's convolutions are Eigen's, which need the batch as the minor axis for a weight gradient and a flipped,
transposed kernel for an input gradient, and ResNet-18's step spends a tenth of its time in those relayouts
(docs/performance.md, "ResNet-18 on this CPU"). oneDNN (PyTorch's CPU backend) has native backward kernels.
``conv_general_dilated`` sends f32 2-D NHWC / HWIO convolutions on CPU to ``onednn_conv.cc`` (forward; input
and weight gradients in one backward call) and everything else to XLA's own, so a model that takes it runs
unchanged on a GPU (``lax.platform_dependent``: GPU lowering never sees the CPU call) and under every strategy
(``onednn_calls``: partitioned along the batch under jit, per device inside shard_map).

The library is compiled on first use (g++, seconds; ``onednn_build``: the cache, its digests, what goes wrong);
``python -m jaxtrain.kernels.onednn`` builds it and says whether it is usable (exit 1 and why where it is not).
Without a compiler or oneDNN, ``available()`` is False and ``reason()`` says why: ``conv="auto"`` then keeps XLA's
convolutions, with one warning line on x86-64 Linux (where jaxtrain's cpu-conv extra brings oneDNN); ``path`` says
which convolutions a run takes, and why, for its first line and summary.json.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import sys

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain import settings
from jaxtrain.errors import named
from jaxtrain.kernels import onednn_build
from jaxtrain.kernels import onednn_calls as calls
from jaxtrain.kernels.onednn_build import build, expected  # noqa: F401  (the public names they were)

_TARGETS = ("JaxtrainDnnlConvFwd", "JaxtrainDnnlConvFwdSave", "JaxtrainDnnlConvBwd", "JaxtrainDnnlBmm")
_NHWC = lax.ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))


@functools.cache
def _library() -> ctypes.CDLL | onednn_build.Unusable:
    """The loaded library, its FFI targets registered; or why it cannot be."""
    try:
        lib = onednn_build.load()
    except onednn_build.Unusable as e:
        return e
    for name in _TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    lib.JaxtrainDnnlSavedFloats.restype = ctypes.c_int64
    lib.JaxtrainDnnlSavedFloats.argtypes = [ctypes.c_int64] * 17
    return lib


def unusable() -> onednn_build.Unusable | None:
    """None when the oneDNN convolutions are usable here; else why not (``.cause``, ``.fix``)."""
    lib = _library()
    return lib if isinstance(lib, onednn_build.Unusable) else None


def reason() -> str | None:
    """None when the oneDNN convolutions are usable here; else why not and what to do (one line)."""
    why = unusable()
    return None if why is None else str(why)


def available() -> bool:
    return unusable() is None


def supported(lhs, rhs, dimension_numbers=None, lhs_dilation=None, rhs_dilation=None, feature_group_count=1,
              batch_group_count=1, preferred_element_type=None) -> bool:
    """Whether oneDNN takes this convolution: 2-D, f32, NHWC / HWIO, no dilation, no groups."""
    if lhs.ndim != 4 or rhs.ndim != 4 or lhs.dtype != jnp.float32 or rhs.dtype != jnp.float32:
        return False
    if lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) != _NHWC:
        return False
    def ones(d):
        return d is None or all(v == 1 for v in d)

    return (ones(lhs_dilation) and ones(rhs_dilation) and feature_group_count == 1 and batch_group_count == 1
            and preferred_element_type in (None, jnp.float32))


def choose(conv: str):
    """(name, fn) of the convolution ``conv`` names: "xla" (``lax``'s), "onednn" (a ConfigError where it is not
    usable), or "auto": oneDNN's on a CPU backend where it is usable, else XLA's (on x86-64 Linux, where oneDNN
    was expected, with one warning line: why, and the fix). oneDNN's: its thread count checked now
    (``onednn_calls.threads``)."""
    from jaxtrain.choices import CONVS
    from jaxtrain.errors import ConfigError

    if conv not in CONVS:
        raise ConfigError(f"unknown conv {conv!r}: choose one of {', '.join(CONVS)}")
    if conv == "onednn" and not available():
        raise ConfigError(f"{named('conv', 'onednn')}: {reason()}; or use {named('conv', 'xla')}")
    if conv == "onednn" or (conv == "auto" and jax.default_backend() == "cpu" and usable_or_say()):
        calls.threads()  # a bad $JAXTRAIN_ONEDNN_THREADS fails here, not when the step is traced
        return "onednn", conv_general_dilated
    return "xla", lax.conv_general_dilated


def usable_or_say(what: str = "convolutions", slower: str = "ResNet-18 and LeNet") -> bool:
    """``available()``; where not, on a CPU backend on x86-64 Linux (where oneDNN was expected), one warning
    line (once per ``what``): why, the fix, and that XLA's ``what`` run instead (slower for ``slower``)."""
    if available():
        return True
    if expected() and jax.default_backend() == "cpu":
        _say_fallback(reason(), what, slower)
    return False


@functools.cache
def _say_fallback(why: str, what: str = "convolutions", slower: str = "ResNet-18 and LeNet") -> None:
    onednn_build.note(f"oneDNN's {what} are not usable ({why}); XLA's run instead (slower for {slower} on CPUs)")


def path(conv: str, chosen: str, platform: str) -> str:
    """Which convolutions a run takes, for its first line and summary.json: "onednn (N threads)", or "xla (why)".
    ``conv``: the setting; ``chosen``: what ``choose`` gave (a model's ``conv``); ``platform``: its devices'."""
    if platform != "cpu":
        return f"xla ({platform.upper()})"
    if chosen == "onednn":
        n = calls.threads()
        return f"onednn ({n} thread{'s' * (n != 1)})"
    if conv == "xla":
        return f"xla ({named('conv', 'xla')})"
    if (why := unusable()) is None:
        return "xla (the model's own)"
    return f"xla ({why.cause}{'' if expected() else '; not x86-64 Linux'})"


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None, out_sharding=None):
    """``lax.conv_general_dilated``: oneDNN's on CPU where ``supported`` (and the library ``available``),
    XLA's everywhere else (other platforms, dtypes, layouts, an ``out_sharding`` asked for)."""
    options = dict(lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                   feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                   preferred_element_type=preferred_element_type)
    def xla(x, w):
        return lax.conv_general_dilated(x, w, window_strides, padding, precision=precision,
                                        out_sharding=out_sharding, **options)

    if out_sharding is not None or not supported(lhs, rhs, **options) or not usable_or_say():
        return xla(lhs, rhs)
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], rhs.shape[:2], window_strides, padding)
    geometry = (tuple(int(s) for s in window_strides), tuple(tuple(int(p) for p in pair) for pair in padding))
    floats = _saved_floats(lhs.shape, rhs.shape, geometry)
    def fast(x, w):
        return calls.conv(x, w, geometry, tuple(lhs.shape[1:]), floats)

    return lax.platform_dependent(lhs, rhs, cpu=fast, default=xla)


def _saved_floats(x_shape, w_shape, geometry) -> int:
    """Per example, the size of x in the layout oneDNN's backward-weights kernel reads, where the forward can
    save it there: that layout keeps each example contiguous, at one size for every share of the batch a device
    may hold (the batch over any divisor of the device count); else 0 (the backward reorders x itself)."""
    (b, h, w, c), (kh, kw, _, o) = x_shape, w_shape
    (sh, sw), ((pt, pb), (pl, pr)) = geometry
    _, ho, wo, _ = calls.out_shape(x_shape, w_shape, geometry)
    n = jax.device_count()
    shares = {b // d for d in range(1, n + 1) if n % d == 0 and b % d == 0}
    blocked = int(settings.current().onednn_blocked)
    sizes = {_library().JaxtrainDnnlSavedFloats(s, h, w, c, kh, kw, o, ho, wo, sh, sw, pt, pb, pl, pr,
                                                calls.threads(), blocked) for s in shares}
    return sizes.pop() if len(sizes) == 1 and min(sizes) > 0 else 0


_SHAPE = re.compile(r"f32\[([\d,]*)\]")
_ATTR = re.compile(r"\b(sh|sw|pt|pb|pl|pr) = (\d+)")
_TRANSPOSED_A = re.compile(r"\bta = 1\b")


def _taps(size: int, kernel: int, stride: int, pad: int, out: int) -> int:
    """Kernel taps that land inside the input, summed over the output positions along one dimension."""
    return sum(sum(0 <= o * stride - pad + k < size for k in range(kernel)) for o in range(out))


def hlo_flops(hlo_text: str) -> float:
    """FLOPs of the oneDNN calls (convolutions and batched products) in a compiled program's HLO text, each line
    once (``call_flops``): XLA's cost analysis counts nothing in a custom call (and may then report a negative
    total). A call in a loop's body is counted once here, as XLA counts the loop's own; ``hlo.matmul_flops`` counts
    it its trip count times."""
    return sum(call_flops(line) for line in hlo_text.splitlines())


def call_flops(line: str) -> float:
    """FLOPs of one line of HLO text if it is a oneDNN call, counted from its shapes as XLA counts its own (2 per
    multiply-add, a convolution's taps in the padding left out); else 0."""
    if 'custom_call_target="JaxtrainDnnlBmm"' in line:  # [..., M, P] from op(a) [..., M, K]: 2 N M K P
        out = [int(d) for d in _SHAPE.search(line.split("= ", 1)[1]).group(1).split(",")]
        a = [int(d) for d in _SHAPE.search(line.split("operand_layout_constraints=")[1]).group(1).split(",")]
        return 2 * math.prod(out) * a[-2 if _TRANSPOSED_A.search(line.split("backend_config=")[1]) else -1]
    if 'custom_call_target="JaxtrainDnnlConv' not in line:
        return 0.0
    dims = [[int(d) for d in s.split(",")] for s in _SHAPE.findall(line.split("operand_layout_constraints=")[1])]
    a = {k: int(v) for k, v in _ATTR.findall(line.split("backend_config=")[1])}
    first = [int(d) for d in _SHAPE.search(line.split("= ", 1)[1]).group(1).split(",")]  # y, or dx
    fwd = "JaxtrainDnnlConvFwd" in line  # operands x, w (-> y); else dy, w, saved (-> dx, dw)
    (b, h, w, c), (kh, kw, _, o) = dims[0] if fwd else first, dims[1]
    y = first if fwd else dims[0]
    taps = _taps(h, kh, a["sh"], a["pt"], y[1]) * _taps(w, kw, a["sw"], a["pl"], y[2])
    return (1 if fwd else 2) * 2 * b * o * c * taps  # backward: the input and the weight gradients


if __name__ == "__main__":  # python -m jaxtrain.kernels.onednn: build the library; exit 0 if usable, else 1 and why
    from jaxtrain.io import console

    with console.lines():  # the build's warnings, as a command line says them
        why = reason()
    print(f"oneDNN convolutions: {'not usable: ' + why if why else 'usable (' + _library()._name + ')'}",
          file=sys.stderr if why else sys.stdout)
    sys.exit(1 if why else 0)
