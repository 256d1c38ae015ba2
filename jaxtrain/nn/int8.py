"""int8 ops a model's layers can run: the int8 ones of post-training quantisation, the fake ones of
quantisation-aware training. A model takes them as its ``(conv, matmul)`` (``lenet.apply(..., ops=)``).

- ``INT8_OPS``: the activation becomes int8 with a scale per example, computed from the batch; the weight
  is already int8 (``int8_weight``: a ``qwix.QArray``, a scale per output channel); the conv / dot runs in
  integers (qwix) and is rescaled to float.
- ``QAT_OPS``: the same rounding of weights and activations, done in float with the gradient passed
  straight through, so a model trains to what its int8 export computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.errors import named, need

qwix = need("qwix", f"int8 quantisation ({named('quantize', 'int8')})")


def int8_weight(w: jax.Array) -> qwix.QArray:
    """int8 values, a float scale per output channel (the last axis: HWIO convs, [in, out] denses)."""
    return qwix.quantize(w, jnp.int8, channelwise_axes=(w.ndim - 1,))


def int8_act(x: jax.Array) -> qwix.QArray:
    """int8 values, a float scale per example (the first axis), computed from ``x`` itself (dynamic)."""
    return qwix.quantize(x, jnp.int8, channelwise_axes=(0,))  # a scale per example, from this batch


def conv(x, w, *args, **kwargs):
    return qwix.conv_general_dilated(int8_act(x), w, *args, **kwargs)


def matmul(x, w):
    return qwix.dot_general(int8_act(x), w, (((x.ndim - 1,), (0,)), ((), ())))


INT8_OPS = (conv, matmul)  # lenet.apply(..., ops=INT8_OPS)


def fake_int8(x: jax.Array, channel_axis: int) -> jax.Array:
    """``x`` rounded to the int8 grid ``int8_weight`` / the activations use (a scale per ``channel_axis`` slice),
    in float; the gradient passes straight through (quantisation-aware training)."""
    rounded = qwix.dequantize(qwix.quantize(x, jnp.int8, channelwise_axes=(channel_axis % x.ndim,)))
    return x + jax.lax.stop_gradient(rounded.astype(x.dtype) - x)


def fake_conv(x, w, *args, **kwargs):
    return jax.lax.conv_general_dilated(fake_int8(x, 0), fake_int8(w, -1), *args, **kwargs)


def fake_matmul(x, w):
    return jnp.matmul(fake_int8(x, 0), fake_int8(w, -1))


QAT_OPS = (fake_conv, fake_matmul)  # training with --quantize int8: the int8 model's numbers, float gradients
