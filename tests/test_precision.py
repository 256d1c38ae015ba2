"""Mixed precision: bf16/fp16 steps equal the same-precision reference and track fp32; fp16's dynamic loss scale
skips bad steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import Reference

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
    """Training at low precision learns like fp32 (that the step computes in bf16/fp16 at all: the test below)."""
    ref, _ = losses("fp32", "jit", n=1)
    got, metrics = losses(precision, strategy)
    assert ref[-1] < ref[0] - 0.05, "the reference must actually learn"
    np.testing.assert_allclose(got, ref, rtol=0.02)
    if precision == "fp16":
        assert metrics["grads_finite"] == 1.0 and metrics["loss_scale"] == 2.0**15


# One step from weights drawn at 0.13 (logits of a few units, where the compute dtype's rounding shows in the loss;
# fp16's 2^15 loss scale does not overflow yet), on 2 devices, against tests/reference.py's step in the same
# precision with the batch split the same way.
INIT_SCALE = 0.13
# The per-example losses are the same ops on the same rows in the same dtype on both sides (bit-equal here); only
# their fp32 mean over 64 examples may be summed in another order: at most 63 roundings of 2^-24 each, 3.8e-6 of
# the loss. The precision moves this loss by 1e-4 (bf16: 1.1e-4, fp16: 9.6e-5 here), 25x more.
LOSS_RTOL = 4e-6
# shard_map's update: the 2 devices' fp32 gradients averaged as the reference averages them (bit-equal here); an
# fp32 step misses it by 2e-3 (fp16) to 8e-2 (bf16).
UPDATE_RTOL = 1e-5


def first_step(precision, strategy=None, reduce_dtype=jnp.float32):
    """(loss, params' change) of one step of jaxtrain's ``strategy`` on 2 devices, or (None) the reference's."""
    params = lenet.init_params(jax.random.key(0), scale=INIT_SCALE)
    batch = teacher_batches(1)[0]
    if strategy is None:
        ref = Reference(lenet.loss_fn, optax.sgd(LR), params, precision=precision, devices=2, reduce_dtype=reduce_dtype)
        loss, new = ref.step(batch)["loss"], ref.params
    else:
        trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(LR), mesh=2, strategy=strategy, precision=precision)
        state, metrics = trainer(trainer.init(params), batch)
        loss, new = metrics["loss"], state.params
    change = [np.asarray(b, np.float64) - np.asarray(a, np.float64)
              for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(new)))]
    return float(loss), np.concatenate([c.ravel() for c in change])


def relative(got, want) -> float:
    """Norm-wise relative difference: ||got - want|| / ||want||."""
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_step_equals_the_same_precision_reference(precision, strategy):
    """A step that ignored the precision (computed in fp32) fails: its loss is 25x the tolerance off."""
    loss, change = first_step(precision, strategy)
    want_loss, want = first_step(precision)
    fp32_loss, fp32 = first_step("fp32")
    assert abs(fp32_loss / want_loss - 1) > 10 * LOSS_RTOL, "the precision must show in the loss"
    assert abs(loss / want_loss - 1) <= LOSS_RTOL, (loss, want_loss, fp32_loss)
    assert abs(loss / fp32_loss - 1) > 5 * LOSS_RTOL  # bf16/fp16 differ from fp32
    # The update: shard_map sums the devices' fp32 gradients as the reference does (bit-equal here); under jit,
    # XLA may sum them in the compute dtype, rounding each element once more: at most 1 ulp (seen: 0.25 ulp).
    ulp = float(jnp.finfo({"bf16": jnp.bfloat16, "fp16": jnp.float16}[precision]).eps)
    assert relative(change, want) <= (UPDATE_RTOL if strategy == "shard_map" else ulp)
    assert relative(fp32, want) > 10 * UPDATE_RTOL


def test_policies_and_custom_precision():
    assert jt.Precision().compute_dtype == jnp.float32
    custom = jt.Precision(jnp.bfloat16, reduce_dtype=jnp.bfloat16)
    loss, change = first_step(custom, "shard_map")
    want_loss, want = first_step("bf16", reduce_dtype=jnp.bfloat16)
    assert abs(loss / want_loss - 1) <= LOSS_RTOL
    assert relative(change, want) <= UPDATE_RTOL  # the devices' gradients summed in bf16, as the reference does ...
    assert relative(change, first_step("bf16")[1]) > 10 * UPDATE_RTOL  # ... which fp32's sum misses by a rounding
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
