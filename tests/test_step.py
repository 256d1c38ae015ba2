"""Train/eval steps: every strategy equals the 1-device reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_batch
from reference import reference_runs
from tolerance import assert_state_reassociated, assert_sums_reassociated
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.models import lenet

DEVICES = (1, 2, 4)
BATCHES = [random_batch(64, seed=s) for s in range(3)]
# Adam divides each gradient element by its own magnitude, so elements whose
# gradient is ~1e-8 (dead units: float noise) turn re-association differences
# between device counts (~1e-3 relative at that size) into update differences
# of lr * 1e-3. eps=1e-6 damps those noise-level elements only; everything
# else about Adam (its per-parameter state, bias correction) is exercised.
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.2), "adam": lambda: optax.adam(1e-3, eps=1e-6)}


def init_params():
    return lenet.init_params(jax.random.key(0), scale=0.1)  # larger than d2l's: gradients far from 0


def train(strategy, n, opt):
    trainer = jt.make_train_step(lenet.loss_fn, OPTIMIZERS[opt](), mesh=n, strategy=strategy)
    state = trainer.init(init_params())
    history = []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return jax.device_get(state), history


@pytest.fixture(scope="module")
def reference():
    """The independent reference step (tests/reference.py) on the same batches, in fp32 and in float64: every
    strategy and device count, 1 device included, is compared with code that shares nothing with jaxtrain's
    step, by the tolerance policy (tests/tolerance.py)."""
    return {opt: reference_runs(lenet.loss_fn, OPTIMIZERS[opt], init_params(), BATCHES) for opt in OPTIMIZERS}


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_strategy_equals_one_device_reference(reference, strategy, n, opt):
    state, history = train(strategy, n, opt)
    assert_state_reassociated(state, history, *reference[opt])
    assert int(state.step) == len(BATCHES)
    # The steps did change the params (a reference that never moved would prove nothing).
    assert not np.allclose(state.params["conv1"]["w"], jax.device_get(init_params())["conv1"]["w"])


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_eval_step_identical_under_every_strategy(strategy):
    params = init_params()
    batch = dict(random_batch(64, seed=9), mask=np.arange(64) < 50)
    ref_state = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=1).init(params)
    ref = jax.device_get(jt.make_eval_step(lenet.eval_fn, mesh=1)(ref_state, batch))
    assert ref["count"] == 50
    logits = np.asarray(lenet.apply(params, batch["image"][:50]))
    assert ref["accuracy"] == (logits.argmax(-1) == batch["label"][:50]).sum()
    for n in DEVICES:
        state = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=n, strategy=strategy).init(params)
        got = jax.device_get(jt.make_eval_step(lenet.eval_fn, mesh=n, strategy=strategy)(state, batch))
        assert got["accuracy"] == ref["accuracy"] and got["count"] == ref["count"]
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)


@pytest.mark.parametrize("strategy, param_sharding", [("jit", "fsdp"), ("explicit", "zero1"), ("shard_map", "fsdp"),
                                                     ("ring", "zero1"), ("pmap", "replicated")])
def test_an_evaluator_made_from_a_trainer_uses_its_plan(strategy, param_sharding):
    """``make_eval_step(eval_fn, trainer=)``: the trainer's plan places the state and its strategy sums, the same
    sums, bit for bit, as an evaluator that reads the placement from the state."""
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, strategy=strategy,
                                 param_sharding=param_sharding, min_size=16)
    state = trainer.init(init_params())
    batch = dict(random_batch(64, seed=9), mask=np.arange(64) < 50)
    planned = jt.make_eval_step(lenet.eval_fn, trainer=trainer)
    got = jax.device_get(planned(state, batch))
    want = jax.device_get(jt.make_eval_step(lenet.eval_fn, mesh=trainer.mesh, strategy=strategy)(state, batch))
    chex.assert_trees_all_equal(got, want)
    assert got["count"] == 50


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_indivisible_batch_is_clear_error_before_compiling(strategy):
    traces = []

    def loss_fn(*args):
        traces.append(1)
        return lenet.loss_fn(*args)

    trainer = jt.make_train_step(loss_fn, optax.sgd(0.1), mesh=4, strategy=strategy)
    state = trainer.init(init_params())
    with pytest.raises(ValueError, match=r"batch size 30 does not split evenly over 4 devices: use a multiple of 4"):
        trainer(state, random_batch(30))
    with pytest.raises(ValueError, match=r"batch size 1 does not split evenly over 4 devices: use a multiple of 4 "
                                         r"\(e\.g\. 4\)"):  # it said "e.g. 4 or 4"
        trainer(state, random_batch(1))
    assert traces == []


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_no_recompilation_between_steps_and_state_donated(strategy):
    chex.clear_trace_counter()
    traced_loss = chex.assert_max_traces(lenet.loss_fn, n=1)
    trainer = jt.make_train_step(traced_loss, optax.sgd(0.1), mesh=2, strategy=strategy)
    users_params = init_params()
    state = trainer.init(users_params)
    for i in range(3):
        old = state
        state, _ = trainer(state, random_batch(64, seed=i))
        assert old.params["conv1"]["w"].is_deleted(), "the state must be donated"
    # Already-sharded device arrays are accepted without retracing too.
    sharded = trainer.shard(random_batch(64, seed=5))
    trainer(state, sharded)
    # Donation consumes the trainer's copy, never the caller's arrays.
    assert not any(x.is_deleted() for x in jax.tree.leaves(users_params))
    # Reusing a donated state is a clear error, not a crash (it segfaulted on 2+ devices).
    with pytest.raises(jt.ConfigError, match="donated to an earlier step.*pass the state the previous call returned"):
        trainer(old, sharded)
    evaluator = jt.make_eval_step(lenet.eval_fn, mesh=2, strategy=strategy)  # it crashed the process (rc 139)
    with pytest.raises(jt.ConfigError, match="donated to an earlier step"):
        evaluator(old, sharded)


def psum_and_ring(mesh, tree):
    specs = jax.tree.map(lambda _: P(jt.DATA_AXIS), tree)

    def both(t):
        return lax.psum(t, jt.DATA_AXIS), jt.ring_allreduce(t, jt.DATA_AXIS)

    return jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(specs,), out_specs=(specs, specs), check_vma=False))(tree)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_allreduce_equals_psum(n, dtype):
    mesh = jt.make_mesh(jax.devices()[:n])
    rng = np.random.default_rng(n)
    shapes = {"a": (5,), "b": (3, 7), "c": {"d": (1,), "e": (2, 3, 11)}, "f": ()}
    # Per-device values stacked on a leading axis of size n (sizes not divisible by n on purpose).
    tree = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=(n, *s)), dtype), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
    tree["ints"] = jnp.asarray(rng.integers(-5, 5, (n, 4)), jnp.int32)  # mixed dtypes in one tree
    expected, got = psum_and_ring(mesh, tree)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        assert e.dtype == g.dtype and e.shape == g.shape
    # ... and the sum is right, not merely equal to psum: every device holds the total (each device's copy of a
    # leaf against psum's; the sum's terms are the n devices' values).
    if dtype == jnp.float32:
        for d in range(n):
            copy = jax.tree.map(lambda x, d=d: np.asarray(x[d]), (got, expected))
            assert_sums_reassociated(*copy, tree, f"device {d}")
        assert_sums_reassociated(got["b"][0], np.asarray(tree["b"], np.float64).sum(0), tree["b"], "total")
    else:  # bf16 sums: each of the n - 1 adds rounds to bf16's 8 bits
        tol = {"rtol": 2e-2, "atol": 5e-2}
        for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), **tol)
        total = np.asarray(tree["b"], np.float32).sum(0)
        for d in range(n):
            np.testing.assert_allclose(np.asarray(got["b"][d], np.float32), total, **tol)


def loss_with_batch_stats(params, model_state, batch, rng):
    """A linear model that also tracks the batch mean of its inputs (like BatchNorm)."""
    x = batch["image"].reshape(batch["image"].shape[0], -1)
    logits = x @ params["w"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * x.mean(0)}
    return loss, (new_state, {})


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_model_state_averaged_over_devices(strategy):
    batch = random_batch(64, seed=4)
    batch["image"][:32] += 1.0  # the two halves (two devices' shards) differ
    params = {"w": jnp.zeros((784, 10))}
    model_state = {"mean": jnp.zeros(784)}
    ref_tr = jt.make_train_step(loss_with_batch_stats, optax.sgd(0.1), mesh=1)
    ref, _ = ref_tr(ref_tr.init(params, model_state), batch)
    for n in (2, 4):
        tr = jt.make_train_step(loss_with_batch_stats, optax.sgd(0.1), mesh=n, strategy=strategy)
        got, _ = tr(tr.init(params, model_state), batch)
        chex.assert_trees_all_close(got.model_state, ref.model_state, rtol=1e-6, atol=1e-7)
    expected = 0.1 * batch["image"].reshape(64, -1).mean(0)
    np.testing.assert_allclose(np.asarray(ref.model_state["mean"]), expected, rtol=1e-5)


@pytest.mark.parametrize(("bad", "says"), [
    (lambda out: out[0], r"must return \(loss, \(model_state, metrics\)\)"),  # loss alone
    (lambda out: (out[0], out[1][1]), r"must return \(loss, \(model_state, metrics\)\)"),  # no model state
    (lambda out: (out[0] * jnp.ones(3), out[1]), r"a loss of shape \(3,\)"),
    (lambda out: (out[0], (out[1][0], {"accuracy": jnp.ones(16)})), r"metrics \{'accuracy': \(16,\)\} are not scalars"),
])
def test_a_loss_fn_with_the_wrong_output_is_a_config_error_naming_the_contract(bad, says):
    def loss_fn(*args):
        return bad(lenet.loss_fn(*args))

    trainer = jt.make_train_step(loss_fn, optax.sgd(0.1), mesh=1)
    with pytest.raises(jt.ConfigError, match=says):
        trainer(trainer.init(init_params()), random_batch(16))
