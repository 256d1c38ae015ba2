"""The GPT's causal attention on CPU with its two batched products on oneDNN (``onednn_conv.cc``'s ``Bmm``).

XLA:CPU computes a batched product's small products (the mini GPT's 128 of 128x64x128) one after another on one
core; oneDNN's batched matmul spreads them over the cores, as PyTorch does (docs/language-models.md, "Where the
rest goes on this CPU"). ``attention`` is ``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` in f32 with the
scores and the weighted sum (and their gradients: ``bmm``'s VJP is four more calls) as oneDNN calls; the mask and
the softmax stay XLA's. Each item's product was the same whatever the items beside it (on 1 and 2 threads), so a
device's share of the items computes their products as the whole batch does, bit for bit.

Under every strategy (the convolutions' way, ``onednn_calls``): under ``jit`` each call is a
``custom_partitioning`` that keeps the items split as the first operand is (the batch and the heads);
inside ``shard_map`` (``ring``, ``pmap``) each device's call is its own. On other platforms it is
``jax.nn.dot_product_attention`` (``lax.platform_dependent``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.core.compat import varying_axes
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import onednn, onednn_build
from jaxtrain.kernels import onednn_calls as calls


def _ffi(a, b, ta: int, tb: int):
    """op(a) @ op(b) per item (the two leading dims): a [B, H, M, K] ([B, H, K, M] where ``ta``), b [B, H, K, P]
    ([B, H, P, K] where ``tb``)."""
    if (why := onednn.unusable()) is not None:  # the library's targets are registered as it loads
        raise ConfigError(f"oneDNN's batched products: {why}")  # bmm called where attention() would fall back
    m, p = a.shape[-1 if ta else -2], b.shape[-2 if tb else -1]
    out = jax.ShapeDtypeStruct((*a.shape[:-2], m, p), a.dtype)
    return jax.ffi.ffi_call("JaxtrainDnnlBmm", out)(a, b, ta=ta, tb=tb, threads=calls.threads())


@functools.cache
def _split(ta: int, tb: int):
    """The call as a ``custom_partitioning``: a, b and the result split along the items (the batch and the heads)
    as ``a`` is."""
    a, b = ("b h k m" if ta else "b h m k"), ("b h p k" if tb else "b h k p")

    def call(a, b):
        return _ffi(a, b, ta, tb)

    rule = f"{a}, {b} -> b h m p"
    whole = tuple(dict.fromkeys(f for f in rule.replace(",", " ").split() if f in "mkp"))  # in order of first use
    return calls.partitioned(call, 2, rule, whole, (True, True), (True,), lead=2)


def _product(a, b, ta: int, tb: int):
    if calls.manual():
        return calls.as_varying(_ffi(a, b, ta, tb), varying_axes(a) | varying_axes(b))
    return _split(ta, tb)(a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def bmm(a, b, ta: int = 0, tb: int = 0):
    """op(a) @ op(b) per item, f32 on CPU (oneDNN's): a [B, H, M, K] (or [B, H, K, M]: ``ta``), b [B, H, K, P]
    (or [B, H, P, K]: ``tb``) -> [B, H, M, P]."""
    return _product(a, b, ta, tb)


def _bmm_fwd(a, b, ta, tb):
    return _product(a, b, ta, tb), (a, b)


def _bmm_bwd(ta, tb, res, g):
    """c = A B: dA = g B^T and dB = A^T g, each transposed back where ``a`` holds A^T or ``b`` B^T."""
    a, b = res
    da = _product(b, g, tb, 1) if ta else _product(g, b, 0, 1 - tb)
    db = _product(g, a, 1, ta) if tb else _product(a, g, 1 - ta, 0)
    if calls.manual():
        return calls.cotangent(da, a, g), calls.cotangent(db, b, g)
    return da, db


bmm.defvjp(_bmm_fwd, _bmm_bwd)


def _causal(q, k, v):
    t, c = q.shape[1], q.shape[3]
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, H, T, C]
    scores = bmm(qh, kh, 0, 1) * jnp.asarray(c ** -0.5, q.dtype)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
    return bmm(jax.nn.softmax(scores, axis=-1), vh, 0, 0).transpose(0, 2, 1, 3)


def _partly_manual() -> bool:
    """Traced inside a shard_map that leaves mesh axes of more than one device to the partitioner (jit's and the
    explicit strategy's accumulation: 'data' manual, 'model' not): a bare call there would be gathered whole on
    every device over those axes (a review's finding: the heads all-gathered over 'model')."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes)
    left = tuple(a for a, n in zip(mesh.axis_names, mesh.axis_sizes) if a not in manual and n > 1)
    if manual and left:
        _say_partly_manual(left)
    return bool(manual and left)


@functools.cache
def _say_partly_manual(axes: tuple) -> None:
    onednn_build.note(f"the GPT's attention runs XLA's products here, not oneDNN's: inside a shard_map that leaves "
                      f"{', '.join(axes)} to the partitioner (an accumulation or a pipeline on such a mesh), "
                      "oneDNN's calls would be gathered whole on every device")


def attention(q, k, v):
    """Causal self-attention of q, k, v [B, T, H, C] (f32) -> [B, T, H, C]: oneDNN's products on CPU,
    ``jax.nn.dot_product_attention``'s (XLA's) elsewhere, and on a CPU where the library is not usable (said once,
    ``usable_or_say``) or inside a partly manual shard_map (``_partly_manual``)."""
    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    if _partly_manual() or not usable_or_say():
        return xla(q, k, v)
    return lax.platform_dependent(q, k, v, cpu=_causal, default=xla)


def chosen(conv: str) -> bool:
    """Whether a CPU's GPT takes oneDNN's products under ``conv`` (the convolutions' setting, ``onednn.choose``'s
    values): "onednn" (a ConfigError where the library is not usable), "auto" where it is usable (else one warning
    line, ``usable_or_say``), not "xla"."""
    if conv != "auto":
        return onednn.choose(conv)[0] == "onednn"  # an unknown conv, or "onednn" unusable: its one-line error
    if not usable_or_say():
        return False
    calls.threads()  # a bad $JAXTRAIN_ONEDNN_THREADS fails here, not when the step is traced
    return True


def usable_or_say() -> bool:
    """``onednn.usable_or_say`` for the attention's products: one warning line (once) where they fall back."""
    return onednn.usable_or_say("attention products", "the GPT")
