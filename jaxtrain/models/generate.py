"""Sampling from the GPT (jaxtrain.models.gpt) with a KV cache, the whole generation one jitted program.

    prompt [B, P] -> prefill: the prompt through every block in one pass, its keys and values written to the cache
    -> new_tokens steps (a ``lax.scan``): sample a token from the last position's logits, run it alone through
    the L blocks at its position, attending over the cache's entries up to it

The cache holds, per layer, the keys and values of every position so far, ``[L, B, seq_len, H, C]``: a fixed
size, so every step has the same shapes and the loop compiles once; the entries past the current position are
masked out of the attention (they get no weight), so a step's logits are ``gpt.apply``'s at that position
(rotary positions: each new key is turned by its position before it is cached, each query by its own). The
block's math is ``gpt.block``'s (same weights' layout, LayerNorm, GELU tanh approximation); only its attention
reads its keys and values from the cache, always XLA's (a boolean mask over the cache, one query a step: nothing
for a fused kernel to win). Logits are fp32; temperature 0 is greedy (argmax), ``top_k`` samples among the k
most likely tokens only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.errors import ConfigError, named
from jaxtrain.models import gpt


def _block(p, x, cache, start, config: gpt.Config):
    """``gpt.block`` for the tokens ``x`` [B, T, D] at positions ``start..start+T-1``: their keys and values
    written into the layer's ``cache`` (k, v ``[B, seq_len, H, C]``; None: a new one, zeros past them), the
    attention over the cache's entries up to each token's position. Returns (x, cache)."""
    t = x.shape[1]
    q, k, v = gpt.attention_inputs(p, x, start + jnp.arange(t), config)  # rotary: turned by their positions
    if cache is None:  # the prefill (start 0): the cache starts as the prompt's keys and values, then zeros
        pad = ((0, 0), (0, config.seq_len - t), (0, 0), (0, 0))
        cache = jnp.pad(k, pad), jnp.pad(v, pad)
    else:
        cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=1)
                      for c, new in zip(cache, (k, v)))
    seen = jnp.arange(config.seq_len)[None, :] <= start + jnp.arange(t)[:, None]  # [T, seq_len]: key <= query
    att = jax.nn.dot_product_attention(q, *cache, mask=seen[None, None], implementation="xla")  # [B, T, H, C]
    x = x + jnp.einsum("bthc,hcd->btd", att, p["proj"]) + p["proj_b"]
    h = gpt.layer_norm(x, p["ln2"], p["ln2_b"]) @ p["fc"] + p["fc_b"]
    h = jax.nn.gelu(h, approximate=True)
    return x + h @ p["out"] + p["out_b"], cache


def _forward(params, tokens, cache, start, config: gpt.Config):
    """Tokens [B, T] at positions ``start..start+T-1`` -> (fp32 logits [B, T, vocab], the updated cache: k, v
    ``[L, B, seq_len, H, C]``). ``cache`` None: the prefill (``start`` 0); else one step (T = 1)."""
    E = params["embed"]
    x = gpt.embed(E, tokens, start, config)

    def layer(x, pc):
        return _block(pc[0], x, pc[1], start, config)

    x, cache = jax.lax.scan(layer, x, (params["stages"], cache))
    return gpt.logits(params["head"], E, x, config).astype(jnp.float32), cache


def _sample(logits, key, temperature, top_k: int | None, greedy: bool):
    """One token per row of ``logits`` [B, vocab]: the argmax (greedy), or drawn from softmax(logits /
    temperature) over all tokens or the ``top_k`` most likely."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k is None:
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
    top, idx = jax.lax.top_k(logits, top_k)
    choice = jax.random.categorical(key, top / temperature)
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "new_tokens", "top_k", "greedy"))
def _generate(params, prompt, key, temperature, *, config: gpt.Config, new_tokens: int, top_k: int | None,
              greedy: bool):
    """The prefill, then ``new_tokens`` sampled one by one, each run through the blocks to give the next
    one's logits (the last one's never needed): int32 [B, P + new_tokens]."""
    p = prompt.shape[1]
    keys = jax.random.split(key, new_tokens)
    logits, cache = _forward(params, prompt, None, 0, config)
    first = _sample(logits[:, -1], keys[0], temperature, top_k, greedy)

    def step(carry, xs):
        token, cache = carry
        pos, k = xs
        logits, cache = _forward(params, token[:, None], cache, pos, config)
        token = _sample(logits[:, 0], k, temperature, top_k, greedy)
        return (token, cache), token

    positions = p + jnp.arange(new_tokens - 1)  # the position of each step's input token
    _, rest = jax.lax.scan(step, (first, cache), (positions, keys[1:]))
    return jnp.concatenate([prompt, first[:, None], rest.T], axis=1)


def generate(params, config: gpt.Config, prompt: jax.Array | np.ndarray, new_tokens: int, *, key: jax.Array,
             temperature: float = 1.0, top_k: int | None = None) -> jax.Array:
    """prompt int32 [B, P] (P >= 1) -> int32 [B, P + new_tokens]: the prompt, then new_tokens sampled one by one.
    temperature 0: greedy (argmax); top_k: only the k most likely tokens sampled. P + new_tokens <= config.seq_len
    (else a one-line ConfigError: the positions stop at seq_len).

    One jitted program per (config, shapes, new_tokens, top_k, greedy or not): the temperature and the key are
    traced, so sampling again at another temperature does not recompile."""
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ConfigError(f"a prompt of shape {tuple(prompt.shape)}: give int32 tokens [batch, length], length >= 1")
    if new_tokens < 0:
        raise ConfigError(f"new_tokens={new_tokens}: give 0 or more tokens to generate")
    if prompt.shape[1] + new_tokens > config.seq_len:
        raise ConfigError(f"a prompt of {prompt.shape[1]} tokens + {new_tokens} new ones: the GPT's positions stop "
                          f"at seq_len {config.seq_len}; shorten the prompt or generate fewer tokens")
    if temperature < 0:
        raise ConfigError(f"{named('temperature', temperature)}: give 0 (greedy) or more")
    if top_k is not None and not 1 <= top_k <= config.vocab:
        raise ConfigError(f"top_k={top_k}: give a number of tokens in 1..{config.vocab} (the vocabulary), or None")
    if new_tokens == 0:
        return prompt
    greedy = bool(temperature == 0)
    return _generate(params, prompt, key, jnp.float32(temperature), config=config, new_tokens=new_tokens,
                     top_k=None if greedy else top_k, greedy=greedy)
