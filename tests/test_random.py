"""The randomness rule (jaxtrain/core/step.py): dropout draws per strategy, device count, seed and accumulation.

The model's parameters are one row per example: after SGD with lr = batch size, row i holds minus the sum of
example i's dropout masks over the steps, so the trained params show every mask every device drew.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtrain as jt

B, D, STEPS = 16, 64, 2


def mask_model(use_jt_dropout: bool):
    def loss_fn(params, model_state, batch, rng):
        ones = jnp.ones((batch["idx"].shape[0], D))
        if use_jt_dropout:
            mask = jt.dropout(ones, 0.5)
        else:  # what a model does with the key it is given
            mask = jax.random.bernoulli(rng, 0.5, ones.shape) * 2.0
        loss = jnp.sum(mask * params["w"][batch["idx"]]) / batch["idx"].shape[0]
        return loss, (model_state, {})

    return loss_fn


@functools.lru_cache(maxsize=None)  # the tests share their runs
def masks(use_jt_dropout, strategy="jit", n=2, seed=0, accum_steps=1):
    trainer = jt.make_train_step(mask_model(use_jt_dropout), optax.sgd(float(B)), mesh=n, strategy=strategy,
                                 accum_steps=accum_steps)
    state = trainer.init({"w": jnp.zeros((B, D))}, rng=jax.random.key(seed))
    batch = trainer.shard({"idx": np.arange(B, dtype=np.int32)})
    for _ in range(STEPS):
        state, _ = trainer(state, batch)
    out = -np.asarray(state.params["w"])  # the sums of each example's masks
    out.flags.writeable = False
    return out


# Every strategy on one device, on 2 devices, and on 4 devices with 2 scan micro-batches per device.
CONFIGS = [(s, n, k) for s in jt.STRATEGIES for n, k in ((1, 1), (2, 1), (4, 2))]


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_same_seed_strategy_and_devices_give_bit_identical_params_and_another_seed_differs(strategy):
    for use_jt in (False, True):
        a, b = masks(use_jt, strategy, 2), masks.__wrapped__(use_jt, strategy, 2)
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, masks(use_jt, strategy, 2, seed=1))
        assert set(np.unique(a)) <= {0.0, 2.0, 4.0} and 0.3 < (a / (2 * STEPS)).mean() < 0.7


@pytest.mark.slow  # 12 configurations x 2; the other tests here run a subset of them
def test_no_two_examples_share_a_mask_whatever_the_devices():
    for strategy, n, k in CONFIGS:
        for use_jt in (False, True):
            m = masks(use_jt, strategy, n, accum_steps=k)
            assert len({row.tobytes() for row in m}) == B, (use_jt, strategy, n, k)


def hand_made_masks(seed=0):
    """jt.dropout's documented rule by hand: example i's mask at step s from fold_in(fold_in(fold_in(key(seed),
    s), 0), i) (0: the step's first dropout call), kept with probability 0.5, kept values scaled by 2."""
    total = np.zeros((B, D))
    for step in range(STEPS):
        call_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), 0)
        for i in range(B):
            total[i] += 2.0 * np.asarray(jax.random.bernoulli(jax.random.fold_in(call_key, i), 0.5, (D,)))
    return total


def test_jt_dropout_gives_each_example_the_same_mask_under_every_strategy_device_count_and_scan():
    reference = hand_made_masks()
    for strategy, n, k in CONFIGS:
        np.testing.assert_array_equal(masks(True, strategy, n, accum_steps=k), reference, err_msg=f"{strategy} {n} {k}")


def test_the_keys_a_loss_fn_gets_differ_between_strategies_and_device_counts_as_documented():
    """The rule in jaxtrain/core/step.py: plain jit = one device's key over the whole batch, whatever the device count;
    per-device strategies agree with each other; with other device counts the draws differ."""
    jit = masks(False, "jit", 2)
    np.testing.assert_array_equal(jit, masks(False, "jit", 4))
    np.testing.assert_array_equal(jit, masks(False, "shard_map", 1))
    np.testing.assert_array_equal(masks(False, "shard_map", 2), masks(False, "pmap", 2))
    np.testing.assert_array_equal(masks(False, "shard_map", 2), masks(False, "ring", 2))
    assert not np.array_equal(masks(False, "shard_map", 2), masks(False, "shard_map", 4))
    assert not np.array_equal(masks(False, "shard_map", 2), jit)


def test_dropout_outside_a_train_step_is_a_clear_error_and_deterministic_is_identity():
    x = jnp.ones((4, 3))
    assert jt.dropout(x, 0.5, deterministic=True) is x
    with pytest.raises(jt.ConfigError, match="deterministic=True outside"):
        jt.dropout(x, 0.5)
