"""Remat: same gradients, fewer saved residuals; compiled_stats reads it all."""

import functools

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import random_batch
from tolerance import assert_reassociated

import jaxtrain as jt
from jaxtrain.core import remat
from jaxtrain.models import lenet


def grads(policy, dtype=np.float32):
    batch = random_batch(64, seed=3)
    batch = {**batch, "image": np.asarray(batch["image"], dtype)}
    params = jax.tree.map(lambda x: np.asarray(x, dtype), lenet.init_params(jax.random.key(0), scale=0.1))
    loss = lenet.make_loss_fn(policy)
    return jax.jit(jax.grad(lambda p: loss(p, {}, batch, None)[0]))(params)


def to64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


@functools.cache
def exact_grads():
    """The gradients in float64: the exact values of the tolerance policy (tests/tolerance.py)."""
    with jax.enable_x64(True):
        return jax.device_get(grads("none", np.float64))


def assert_same_gradients(got, want, exact):
    """Re-associated (a remat'ed block is recomputed, maybe fused otherwise), by the policy: a ReLU on its kink may
    flip, KINK of the gradient's size (its "move" from 0)."""
    assert_reassociated(got, want, exact, "grads", jax.tree.map(np.zeros_like, exact))


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch", "everything_saveable", "offload_dots",
                                    "offload_dots_no_batch"])
def test_remat_gives_the_same_gradients(policy):
    assert_same_gradients(grads(policy), grads("none"), exact_grads())


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


def test_offload_policies_offload_what_their_names_say_and_compute_the_same():
    """On a CPU (one memory) the values stay put; which ones a policy offloads is decided at trace time: checked
    through the saved residuals (the GPU compile, tests/test_gpu_compile.py, checks where they go)."""
    from jaxtrain.core.compat import saved_residuals
    from jaxtrain.models import vit

    params = jax.jit(vit.init)(jax.random.key(0))  # jitted: op by op, the ViT's init and grads took minutes
    layer = jax.tree.map(lambda a: a[0], params["stages"])
    x = jax.random.normal(jax.random.key(1), (2, 49, vit.DIM))

    def offloaded(policy):  # the residuals put into host memory (device_put to pinned_host)
        fn = remat.remat(lambda p, x: vit.block(p, x).sum(), policy)
        return sorted(a.shape for a, why in saved_residuals(fn, layer, x) if "device_put" in str(why))

    attention, mlp_hidden, qkv = (2, 49, vit.DIM), (2, 49, vit.MLP), (2, 49, 3 * vit.DIM)
    scores = (2, vit.HEADS, 49, 49)
    assert offloaded("offload_names:mlp_hidden,attention") == sorted([attention, mlp_hidden])
    assert offloaded("offload_dots_no_batch") == sorted([attention, mlp_hidden, qkv])  # projections' outputs
    assert scores in offloaded("offload_dots")  # the attention's batched einsums too
    assert offloaded("dots") == []

    def grad(policy):
        return jax.jit(jax.grad(remat.remat(lambda p, x: vit.block(p, x).sum(), policy)))(layer, x)

    with jax.enable_x64(True):
        exact = jax.device_get(jax.grad(lambda p, x: vit.block(p, x).sum())(*to64((layer, x))))
    assert_same_gradients(grad("offload_names:mlp_hidden,attention"), grad("none"), exact)


def test_offload_names_needs_names_and_a_cpu_run_says_what_offloading_means_there():
    with pytest.raises(jt.ConfigError, match="name the values to offload, e.g. offload_names:mlp_hidden,attention"):
        remat.policy("offload_names:")
    assert "a CPU has one memory" in remat.offload_note("offload_dots", "cpu")
    assert remat.offload_note("offload_dots", "gpu") is None and remat.offload_note("dots", "cpu") is None


def _relayout_of_a_chain(x, scale, keep: bool):
    """BatchNorm-like chain of two activations, then the [B,H,W,C] -> [C,H,W,B] relayout a weight gradient reads."""
    y = jax.numpy.maximum(x * scale + 1, 0) + jax.numpy.maximum(x * scale - 1, 0)
    y = remat.materialize(y) if keep else y
    return jax.numpy.transpose(y, (3, 1, 2, 0)), (y * y).sum()


def test_materialize_is_exact_and_stores_the_value_on_a_cpu_only():
    x, scale = jax.random.normal(jax.random.key(0), (8, 6, 6, 16)), jax.numpy.linspace(0.5, 2, 16)
    kept, plain = (jax.jit(lambda x, s, k=k: _relayout_of_a_chain(x, s, k)) for k in (True, False))
    chex.assert_trees_all_equal(kept(x, scale), plain(x, scale))  # bit for bit, not close
    grad = {k: jax.jit(jax.grad(lambda x, s, k=k: _relayout_of_a_chain(x, s, k)[1], argnums=(0, 1)))
            for k in (True, False)}
    chex.assert_trees_all_equal(grad[True](x, scale), grad[False](x, scale))
    assert "conditional(" in kept.lower(x, scale).compile().as_text()  # what XLA cannot fuse into
    assert "conditional(" not in plain.lower(x, scale).compile().as_text()
    cuda = kept.trace(x, scale).lower(lowering_platforms=("cuda",)).as_text()
    assert "rng_bit_generator" not in cuda  # the GPU program has no CPU branch (only JAX's platform index switch)
    assert "rng_bit_generator" in kept.trace(x, scale).lower().as_text()


def test_materialize_adds_no_collective_under_a_sharded_jit():
    mesh = jt.make_mesh(2)
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(jt.DATA_AXIS))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 6, 6, 16)), batch)
    hlo = {k: jax.jit(lambda x, k=k: _relayout_of_a_chain(x, 2.0, k)[0]).lower(x).compile().as_text()
           for k in (True, False)}
    assert "conditional(" in hlo[True]
    for op in ("all-reduce(", "all-gather(", "collective-permute(", "all-to-all("):
        assert hlo[True].count(op) == hlo[False].count(op), op
