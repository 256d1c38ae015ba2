"""d2l's ResNet-18: shapes, size, synchronised BatchNorm under every strategy, eval mode, remat, bf16."""

import chex
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from conftest import random_batch

import jaxtrain as jt
from jaxtrain.models import resnet

BATCH = random_batch(8, seed=11)


@pytest.fixture(scope="module")
def variables():
    return resnet.init_variables(jax.random.key(0))


def one_step(variables, strategy="jit", n=1, precision="fp32", remat="none", param_sharding="replicated"):
    model = resnet.ResNet18(remat=remat)
    trainer = jt.make_train_step(resnet.make_loss_fn(model), optax.sgd(0.1), mesh=n, strategy=strategy,
                                 precision=precision, param_sharding=param_sharding)
    state, metrics = trainer(trainer.init(*variables), BATCH)
    return jax.device_get(state), jax.device_get(metrics)


@pytest.fixture(scope="module")
def reference(variables):
    return one_step(variables)


def test_shapes_and_parameter_count(variables):
    params, stats = variables
    assert sum(x.size for x in jax.tree.leaves(params)) == 11_175_818
    assert "BatchNorm_0" in stats and all("Dense" not in k for k in stats)
    logits = resnet.ResNet18().apply({"params": params, "batch_stats": stats}, BATCH["image"], train=False)
    assert logits.shape == (8, 10)


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_two_devices_equal_one_device_params_and_batch_stats(variables, reference, strategy):
    ref_state, ref_metrics = reference
    state, metrics = one_step(variables, strategy, n=2)
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.model_state, ref_state.model_state, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(metrics, ref_metrics, rtol=1e-5, atol=1e-6)
    # The statistics did move from their init (mean 0, var 1) toward the GLOBAL batch's.
    assert not np.allclose(state.model_state["BatchNorm_0"]["mean"], 0)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_fsdp_equals_one_device_params_and_batch_stats(variables, reference, strategy):
    ref_state, ref_metrics = reference
    state, metrics = one_step(variables, strategy, n=2, param_sharding="fsdp")
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.model_state, ref_state.model_state, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(metrics, ref_metrics, rtol=1e-5, atol=1e-6)


def test_fsdp_state_takes_a_quarter_of_the_memory_on_four_devices(variables):
    """Compiled per-device argument bytes (params + Adam state, and a small batch) under fsdp vs replicated."""
    model = resnet.ResNet18()
    args = {}
    for sharding in ("replicated", "fsdp"):
        trainer = jt.make_train_step(resnet.make_loss_fn(model), optax.adam(1e-3), mesh=4, param_sharding=sharding)
        state = trainer.init(*variables)
        args[sharding] = jt.compiled_stats(trainer, state, BATCH, residuals=False)["argument_bytes"]
        if sharding == "fsdp":  # every conv kernel and the dense kernel sharded 4 ways
            assert trainer.plan(state.params)["sharded"]["Residual_7/Conv_1/kernel"] == str(P(None, None, None, "data"))
    assert args["fsdp"] <= 0.27 * args["replicated"], args


def test_eval_mode_uses_running_statistics(variables):
    params, stats = variables
    model = resnet.ResNet18()
    run = jax.jit(lambda images: model.apply({"params": params, "batch_stats": stats}, images, train=False))
    alone = run(BATCH["image"][:2])
    other = BATCH["image"].copy()
    other[1:] = 1.0 - other[1:]  # change every other example
    mixed = run(other[:2])
    np.testing.assert_allclose(alone[0], mixed[0], rtol=1e-5, atol=1e-6)


def test_remat_same_gradients_and_fewer_saved_residuals(variables, reference):
    state, _ = one_step(variables, remat="full")
    chex.assert_trees_all_close(state.params, reference[0].params, rtol=1e-5, atol=1e-6)
    saved = {}
    for policy in ("none", "full"):
        model = resnet.ResNet18(remat=policy)
        trainer = jt.make_train_step(resnet.make_loss_fn(model), optax.sgd(0.1), mesh=1)
        saved[policy] = jt.diagnostics.saved_residual_bytes(trainer, trainer.init(*variables), random_batch(128))
    assert saved["full"] <= 0.4 * saved["none"], saved


def test_bf16_first_step_loss_within_2_percent(variables, reference):
    _, metrics = one_step(variables, precision="bf16")
    assert abs(metrics["loss"] / reference[1]["loss"] - 1) < 0.02
