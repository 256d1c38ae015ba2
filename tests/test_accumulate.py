"""Gradient accumulation equals the big-batch step: scan and optax.MultiSteps."""

import chex
import jax
import optax
import pytest
from conftest import random_batch
from reference import Reference

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


BATCHES = [random_batch(128, seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def big_batch():
    """The independent reference (tests/reference.py): one update per 128-example batch, no micro-batches."""
    runs = {}
    for opt in OPTIMIZERS:
        ref = Reference(lenet.loss_fn, OPTIMIZERS[opt](), params())
        runs[opt] = ref, [ref.step(batch) for batch in BATCHES]
    return runs


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_scan_accumulation_equals_big_batch(big_batch, strategy, opt):
    """4 devices x 4 micro-batches of 8, 3 updates: params, optimizer state, step and metrics.

    Tolerance: the gradient sums are re-associated 16 ways (the ring's order too); the bias gradients, sums
    with cancellation, drifted by up to 1.1e-5 in 3 SGD steps here; one update is ~1e-2 (lr 0.2)."""
    ref, ref_history = big_batch[opt]
    trainer = jt.make_train_step(lenet.loss_fn, OPTIMIZERS[opt](), mesh=4, strategy=strategy, accum_steps=4)
    state, history = trainer.init(params()), []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    state = jax.device_get(state)
    assert int(state.step) == ref.step_count == 3
    tol = {"rtol": 1e-5, "atol": 3e-5}
    chex.assert_trees_all_close(state.params, jax.device_get(ref.params), **tol)
    chex.assert_trees_all_close(state.opt_state, jax.device_get(ref.opt_state), **tol)
    chex.assert_trees_all_close(history, ref_history, **tol)


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
