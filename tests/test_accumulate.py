"""Gradient accumulation equals the big-batch step: scan and optax.MultiSteps."""

import chex
import jax
import optax
import pytest
from conftest import random_batch
from reference import float64_steps, reference_runs
from tolerance import assert_state_reassociated

import jaxtrain as jt
from jaxtrain.models import lenet

# eps=1e-6: see test_step.py (Adam magnifies float noise in ~1e-8 gradients).
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.2), "adam": lambda: optax.adam(1e-3, eps=1e-6)}


def params():
    return lenet.init_params(jax.random.key(0), scale=0.1)


BATCHES = [random_batch(128, seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def big_batch():
    """The independent reference (tests/reference.py) as 4 devices x 4 micro-batches compute it, in fp32 and in
    float64; in float64 it is the big-batch step (one update per 128 examples, no micro-batches) to 1e-12.

    In fp32 the micro-batched step is itself up to 1.1e-5 from float64 (conv2's bias after 3 steps; the
    big batch: 4e-9; a ReLU that rounds the other way), so the run is held to it, not to the big batch."""
    runs = {}
    for opt in OPTIMIZERS:
        runs[opt] = reference_runs(lenet.loss_fn, OPTIMIZERS[opt], params(), BATCHES, accum_steps=4, devices=4)
        big = float64_steps(lenet.loss_fn, OPTIMIZERS[opt](), params(), BATCHES)
        chex.assert_trees_all_close(runs[opt][2], big, rtol=1e-12, atol=1e-14)
    return runs


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_scan_accumulation_equals_big_batch(big_batch, strategy, opt):
    """4 devices x 4 micro-batches of 8, 3 updates: params, optimizer state, step and metrics, by the tolerance
    policy (tests/tolerance.py): the gradient sums are re-associated 16 ways (the ring's order too)."""
    ref_state, ref_history, exact = big_batch[opt]
    trainer = jt.make_train_step(lenet.loss_fn, OPTIMIZERS[opt](), mesh=4, strategy=strategy, accum_steps=4)
    state, history = trainer.init(params()), []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    state = jax.device_get(state)
    assert int(state.step) == ref_state.step == 3
    assert_state_reassociated(state, history, ref_state, ref_history, exact)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_multisteps_equals_one_step_on_the_union(strategy):
    batch = random_batch(256, seed=2)
    ref_state, ref_history, exact = reference_runs(lenet.loss_fn, OPTIMIZERS["sgd"], params(), [batch])
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.2), mesh=2, strategy=strategy, accum_steps=4,
                                 accum="multisteps")
    state = trainer.init(params())
    start = jax.device_get(state.params)
    for i in range(4):
        micro = {k: v[i * 64 : (i + 1) * 64] for k, v in batch.items()}
        state, _ = trainer(state, micro)
        if i < 3:  # no update until the k-th call
            chex.assert_trees_all_equal(jax.device_get(state.params), start)
    assert_state_reassociated(jax.device_get(state), [], ref_state, [], exact._replace(history=[]))


def test_accum_steps_must_divide_the_per_device_batch():
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, accum_steps=3)
    with pytest.raises(ValueError, match=r"batch size 64 does not split evenly over 2 devices x 3 micro-batches: "
                                         r"use a multiple of 6"):
        trainer(trainer.init(params()), random_batch(64))
    with pytest.raises(jt.ConfigError, match="accum_steps"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, accum_steps=0)
    with pytest.raises(jt.ConfigError, match="unknown accum"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, accum_steps=2, accum="loop")
