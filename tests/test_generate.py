"""Sampling from the GPT with a KV cache (jaxtrain.models.generate): its greedy tokens and its cached logits held
to ``gpt.apply`` over the whole sequence (learned and rotary positions), sampling's keys and top-k, and the
prompt's checks."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxtrain.errors import ConfigError
from jaxtrain.models import generate as gen
from jaxtrain.models import gpt

# Smaller than gpt.SIZES["tiny"] (fast), a vocabulary that is padded (100 -> 128): the padded columns never sampled
CONFIG = gpt.Config(vocab=100, seq_len=16, layers=2, heads=2, width=32)
ROTARY = dataclasses.replace(CONFIG, rotary=True)  # its positions turn the cached keys and the queries
PROMPT = np.array([[1, 2, 3], [40, 50, 60]], np.int32)


@functools.cache
def params_of(config):
    """GPT-2's init scaled up 5x: logits far from uniform, so the argmax varies from step to step and stands
    clear of the runner-up (no near-ties to flip between two summation orders)."""
    return jax.jit(lambda key: jax.tree.map(lambda x: 5 * x, gpt.init(key, config)))(jax.random.key(0))


@pytest.fixture(scope="module")
def params():
    return params_of(CONFIG)


@pytest.fixture(scope="module")
def apply():
    return jax.jit(gpt.apply, static_argnames="config")


@pytest.mark.parametrize("config", [CONFIG, ROTARY], ids=["learned", "rotary"])
def test_greedy_equals_the_naive_loop_over_the_whole_sequence(config, apply):
    params = params_of(config)
    out = np.asarray(gen.generate(params, config, PROMPT, 10, key=jax.random.key(1), temperature=0))
    seq = PROMPT
    for _ in range(10):  # the whole sequence so far through gpt.apply, the last position's argmax appended
        # (padded with zeros to one length, one compile: a position's logits see only the tokens up to it)
        window = np.pad(seq, ((0, 0), (0, config.seq_len - seq.shape[1])))
        nxt = np.asarray(apply(params, window, config=config))[:, seq.shape[1] - 1].argmax(-1).astype(np.int32)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    assert out.dtype == np.int32 and out.shape == (2, 13)
    np.testing.assert_array_equal(out, seq)
    assert len(np.unique(out[:, 3:])) > 2  # not one token repeated


@pytest.mark.parametrize("config", [CONFIG, ROTARY], ids=["learned", "rotary"])
def test_the_caches_logits_are_applys_at_each_position(config, apply):
    params = params_of(config)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (2, config.seq_len), dtype=np.int32)
    want = np.asarray(apply(params, tokens, config=config))
    forward = jax.jit(gen._forward, static_argnames="config")
    logits, cache = forward(params, tokens[:, :3], None, 0, config=config)  # the prefill
    assert logits.dtype == np.float32 and cache[0].shape == (2, 2, 16, 2, 16)  # [L, B, seq_len, H, C]
    np.testing.assert_allclose(logits, want[:, :3], atol=1e-5, rtol=0)
    for pos in range(3, CONFIG.seq_len):  # one token per step, as generate runs them
        logits, cache = forward(params, tokens[:, pos:pos + 1], cache, pos, config=config)
        np.testing.assert_allclose(logits[:, 0], want[:, pos], atol=1e-5, rtol=0, err_msg=f"position {pos}")


def test_sampling_follows_the_key_and_recompiles_for_neither_key_nor_temperature(params):
    def sample(seed, temperature=1.0):
        return np.asarray(gen.generate(params, CONFIG, PROMPT, 10, key=jax.random.key(seed), temperature=temperature))

    a = sample(1)
    compiled = gen._generate._cache_size()
    np.testing.assert_array_equal(a, sample(1))
    assert (a != sample(2)).any()
    np.testing.assert_array_equal(a[:, :3], PROMPT)
    assert ((a >= 0) & (a < CONFIG.vocab)).all()
    sample(3, temperature=0.7)
    assert gen._generate._cache_size() == compiled


def test_top_k_1_is_greedy(params):
    greedy = gen.generate(params, CONFIG, PROMPT, 10, key=jax.random.key(1), temperature=0)
    top1 = gen.generate(params, CONFIG, PROMPT, 10, key=jax.random.key(5), temperature=1.5, top_k=1)
    np.testing.assert_array_equal(top1, greedy)


def test_top_k_samples_only_among_the_k_most_likely(params, apply):
    k, prompt = 5, np.tile(PROMPT, (4, 1))
    out = np.asarray(gen.generate(params, CONFIG, prompt, 13, key=jax.random.key(7), temperature=3.0, top_k=k))
    # (up to seq_len: the last position's embedding used) the logits each new token came from
    logits = np.asarray(apply(params, out[:, :-1], config=CONFIG))[:, 2:]
    ranks = (logits > np.take_along_axis(logits, out[:, 3:, None], axis=-1)).sum(-1)  # 0: the most likely
    assert ranks.max() < k
    assert (ranks > 0).any()  # sampled, not the argmax every time


def test_the_prompt_is_checked(params):
    key = jax.random.key(0)
    with pytest.raises(ConfigError, match="seq_len 16"):
        gen.generate(params, CONFIG, PROMPT, 14, key=key)
    for empty in (np.zeros((2, 0), np.int32), np.array([1, 2, 3], np.int32)):
        with pytest.raises(ConfigError, match="length >= 1"):
            gen.generate(params, CONFIG, empty, 1, key=key)
    with pytest.raises(ConfigError, match="top_k"):
        gen.generate(params, CONFIG, PROMPT, 1, key=key, top_k=0)
    with pytest.raises(ConfigError, match="temperature"):
        gen.generate(params, CONFIG, PROMPT, 1, key=key, temperature=-1.0)
    np.testing.assert_array_equal(gen.generate(params, CONFIG, PROMPT, 0, key=key), PROMPT)
