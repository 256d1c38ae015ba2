"""Gradient accumulation equals the big-batch step: scan and optax.MultiSteps."""

import chex
import jax
import optax
import pytest
from conftest import random_batch

import jaxtrain as jt
from jaxtrain.models import lenet

# eps=1e-6: see test_step.py (Adam magnifies float noise in ~1e-8 gradients).
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.2), "adam": lambda: optax.adam(1e-3, eps=1e-6)}


def params():
    return lenet.init_params(jax.random.key(0), scale=0.1)


def one_step(opt, batch, n=1, strategy="jit", **kw):
    trainer = jt.make_train_step(lenet.loss_fn, OPTIMIZERS[opt](), mesh=n, strategy=strategy, **kw)
    state, metrics = trainer(trainer.init(params()), batch)
    return jax.device_get(state), jax.device_get(metrics)


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_scan_accumulation_equals_big_batch(strategy, opt):
    batch = random_batch(256, seed=1)
    ref_state, ref_metrics = one_step(opt, batch)
    state, metrics = one_step(opt, batch, n=2, strategy=strategy, accum_steps=4)
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(metrics, ref_metrics, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 1


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_multisteps_equals_one_step_on_the_union(strategy):
    batch = random_batch(256, seed=2)
    ref_state, _ = one_step("sgd", batch)
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.2), mesh=2, strategy=strategy, accum_steps=4,
                                 accum="multisteps")
    state = trainer.init(params())
    start = jax.device_get(state.params)
    for i in range(4):
        micro = {k: v[i * 64 : (i + 1) * 64] for k, v in batch.items()}
        state, _ = trainer(state, micro)
        if i < 3:  # no update until the k-th call
            chex.assert_trees_all_equal(jax.device_get(state.params), start)
    chex.assert_trees_all_close(jax.device_get(state.params), ref_state.params, rtol=1e-5, atol=1e-6)


def test_accum_steps_must_divide_the_per_device_batch():
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, accum_steps=3)
    with pytest.raises(ValueError, match=r"batch size 64 does not split evenly over 2 devices x 3 micro-batches: use a multiple of 6"):
        trainer(trainer.init(params()), random_batch(64))
    with pytest.raises(jt.ConfigError, match="accum_steps"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, accum_steps=0)
    with pytest.raises(jt.ConfigError, match="unknown accum"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, accum_steps=2, accum="loop")
