"""Mixed precision: bf16/fp16 track fp32; fp16's dynamic loss scale skips bad steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtrain as jt
from jaxtrain.models import lenet

LR = 0.01  # a stable regime: with large steps (lr >= 0.03 here) training is chaotic and rounding compounds


def teacher_batches(count, size=64, seed=0):
    """Random images labelled by a fixed linear teacher: learnable, so the loss falls."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(784, 10)).astype(np.float32)
    out = []
    for _ in range(count):
        images = rng.random((size, 28, 28, 1), dtype=np.float32)
        out.append({"image": images, "label": (images.reshape(size, -1) @ teacher).argmax(-1).astype(np.int32)})
    return out


def losses(precision, strategy, n=2, steps=20):
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(LR), mesh=n, strategy=strategy, precision=precision)
    state = trainer.init(lenet.init_params(jax.random.key(0), scale=0.1))
    out = []
    for batch in teacher_batches(steps):
        state, metrics = trainer(state, batch)
        out.append(float(metrics["loss"]))
    return np.array(out), jax.device_get(metrics)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_losses_track_fp32(precision, strategy):
    ref, _ = losses("fp32", "jit", n=1)
    got, metrics = losses(precision, strategy)
    assert ref[-1] < ref[0] - 0.05, "the reference must actually learn"
    np.testing.assert_allclose(got, ref, rtol=0.02)
    if precision == "fp16":
        assert metrics["grads_finite"] == 1.0 and metrics["loss_scale"] == 2.0**15


def test_policies_and_custom_precision():
    assert jt.Precision().compute_dtype == jnp.float32
    custom = jt.Precision(jnp.bfloat16, reduce_dtype=jnp.bfloat16)
    got, _ = losses(custom, "shard_map", steps=3)
    ref, _ = losses("fp32", "jit", n=1, steps=3)
    np.testing.assert_allclose(got, ref, rtol=0.02)
    with pytest.raises(jt.ConfigError, match="unknown precision"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=1, precision="fp8")


def host_copy(tree):
    return jax.tree.map(lambda x: np.array(x), jax.device_get(tree))


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_fp16_overflow_on_one_device_skips_update_everywhere(strategy):
    policy = jt.Precision(jnp.float16, loss_scale="dynamic", growth_interval=3)
    trainer = jt.make_train_step(lenet.loss_fn, optax.adam(1e-3), mesh=2, strategy=strategy, precision=policy)
    state = trainer.init(lenet.init_params(jax.random.key(0), scale=0.1))
    good = teacher_batches(4)
    for batch in good[:3]:  # 3 finite steps -> the scale doubles once
        state, metrics = trainer(state, batch)
        assert metrics["grads_finite"] == 1.0
    assert float(state.loss_scale["scale"]) == 2.0**16
    before = host_copy((state.params, state.opt_state))

    bad = dict(good[3])
    bad["image"] = bad["image"].copy()
    bad["image"][40] = 1e5  # above fp16's max (65504): inf on the device holding rows 32..63 only
    state, metrics = trainer(state, bad)
    assert metrics["grads_finite"] == 0.0
    assert float(state.loss_scale["scale"]) == 2.0**15
    after_params, after_opt = state.params, state.opt_state
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves((after_params, after_opt))):
        for shard in new.addressable_shards:  # every device's copy, bit for bit
            np.testing.assert_array_equal(np.asarray(shard.data), old)
    state, metrics = trainer(state, good[0])  # and training goes on
    assert metrics["grads_finite"] == 1.0 and int(state.step) == 5
