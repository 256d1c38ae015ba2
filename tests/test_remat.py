"""Remat: same gradients, fewer saved residuals; compiled_stats reads it all."""

import chex
import jax
import optax
import pytest
from conftest import random_batch

import jaxtrain as jt
from jaxtrain import remat
from jaxtrain.models import lenet


def grads(policy):
    batch = random_batch(64, seed=3)
    loss = lenet.make_loss_fn(policy)
    return jax.jit(jax.grad(lambda p: loss(p, {}, batch, None)[0]))(lenet.init_params(jax.random.key(0), scale=0.1))


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch", "everything_saveable"])
def test_remat_gives_the_same_gradients(policy):
    chex.assert_trees_all_close(grads(policy), grads("none"), rtol=1e-5, atol=1e-7)


def stats(policy, batch_size=1024, n=2):
    trainer = jt.make_train_step(lenet.make_loss_fn(policy), optax.sgd(0.1), mesh=n)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    return jt.compiled_stats(trainer, state, random_batch(batch_size))


def test_full_remat_cuts_saved_residuals_and_temp_memory():
    none, full = stats("none"), stats("full")
    assert full["saved_residual_bytes"] <= 0.4 * none["saved_residual_bytes"], (none, full)
    assert full["temp_bytes"] <= 0.8 * none["temp_bytes"], (none, full)
    assert none["flops"] > 0 and full["flops"] >= none["flops"]  # recomputation costs FLOPs
    assert none["alias_bytes"] > 0  # the donated state is written in place


def test_unknown_policy_lists_the_names():
    with pytest.raises(jt.ConfigError, match="unknown remat policy 'some'.*full.*dots"):
        remat.policy("some")
    assert {"none", "full", "dots", "dots_no_batch", "nothing_saveable"} <= set(remat.names())
