"""jt.from_nnx: an NNX module trains under every strategy and sharding exactly as on 1 device."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_batch
from flax import nnx
from reference import Exact
from tolerance import assert_state_reassociated
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.models import classify
from jaxtrain.nn.flax_nnx import Dropout

BATCHES = [random_batch(32, seed=s) for s in range(3)]


class Net(nnx.Module):
    """Conv, BatchNorm, dropout, a dense layer annotated for tensor parallelism; NNX's train()/eval() modes."""

    def __init__(self, rngs: nnx.Rngs, dropout=None):
        self.conv = nnx.Conv(1, 8, (3, 3), strides=2, use_bias=False, rngs=rngs)  # a bias before BN: no gradient
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.hidden = nnx.Linear(14 * 14 * 8, 64, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")))
        self.drop = Dropout(0.3) if dropout is None else dropout
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):  # no `train` argument: the adapter sets the modes
        x = nnx.relu(self.bn(self.conv(x)))
        return self.out(self.drop(nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))))


def adapter(dropout=None):
    with nnx.use_eager_sharding(False):  # annotations kept as metadata; the step places the arrays
        model = Net(nnx.Rngs(0), dropout)
    return jt.from_nnx(model, loss=lambda logits, b: classify.mean_loss(logits, b["label"]),
                       per_example=lambda logits, b: classify.per_example(logits, b["label"]))


def train(mesh=1, dropout=None, **kw):
    net = adapter(dropout)
    trainer = jt.make_train_step(net.loss_fn, optax.sgd(0.1), mesh=mesh, **kw)  # Adam: see test_step
    state = trainer.init(net.params, net.model_state, jax.random.key(1))
    history = []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return net, trainer, state, history


@pytest.fixture(scope="module")
def reference():
    return train()


@pytest.fixture(scope="module")
def exact():
    """The 1-device step in float64: the exact values of the tolerance policy (tests/tolerance.py). The
    independent reference (tests/reference.py) cannot draw jt.dropout's per-example masks; this run draws the very
    masks the fp32 runs draw (jt.dropout draws them in fp32 whatever the dtype)."""
    wide = jt.Precision(compute_dtype=jnp.float64, param_dtype=jnp.float64, output_dtype=jnp.float64,
                        reduce_dtype=jnp.float64)

    def to64(tree):
        return jax.tree.map(lambda x: np.asarray(x, np.float64) if np.asarray(x).dtype.kind == "f" else x, tree)

    with jax.enable_x64(True):
        net = adapter()
        trainer = jt.make_train_step(net.loss_fn, optax.sgd(0.1), mesh=1, precision=wide)
        state = trainer.init(to64(net.params), to64(net.model_state), jax.random.key(1))
        history = []
        for batch in BATCHES:
            state, metrics = trainer(state, to64(batch))
            history.append(jax.device_get(metrics))
        state = jax.device_get(state)
        return Exact(state.params, state.opt_state, state.model_state, history, to64(net.params),
                     to64(net.model_state))


def assert_same(reference, exact, state, history):
    _, _, ref_state, ref_history = reference
    assert_state_reassociated(jax.device_get(state), history, jax.device_get(ref_state), ref_history, exact)


def test_the_reference_updates_its_parameters_and_batch_statistics(reference):
    net, _, state, history = reference
    assert all(np.isfinite(h["loss"]) for h in history)
    assert not np.allclose(jax.device_get(state.params["hidden"]["kernel"]), net.params["hidden"]["kernel"])
    assert not np.allclose(jax.device_get(state.model_state["bn"]["mean"]), net.model_state["bn"]["mean"])
    assert set(state.params) == {"conv", "bn", "hidden", "out"} and set(state.model_state) == {"bn"}


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
@pytest.mark.parametrize("n", [2, 4])
def test_every_strategy_equals_one_device_with_per_example_dropout(reference, exact, strategy, n):
    _, _, state, history = train(n, strategy=strategy)
    assert_same(reference, exact, state, history)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_fsdp_equals_one_device(reference, exact, strategy):
    _, trainer, state, history = train(4, strategy=strategy, param_sharding="fsdp", min_size=512)
    assert_same(reference, exact, state, history)
    assert state.params["hidden"]["kernel"].sharding.spec == P("data", None)


def test_the_modules_own_annotations_are_the_sharding_rules(reference, exact):
    net = adapter()
    assert net.rules == [("^hidden/kernel$", P(None, "model"))]
    mesh = jt.make_mesh(jax.devices()[:4], axes={"data": 2, "model": 2})
    _, trainer, state, history = train(mesh, param_sharding=net.rules)
    assert state.params["hidden"]["kernel"].sharding.spec == P(None, "model")
    assert_same(reference, exact, state, history)


def test_stock_nnx_dropout_draws_from_the_step_key():
    one = train(dropout=nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=5)))[3]
    again = train(dropout=nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=6)))[3]  # its own seed does not matter...
    chex.assert_trees_all_equal(one, again)
    without = train(dropout=nnx.Dropout(0.0, rngs=nnx.Rngs(dropout=5)))[3]  # ...the step's key does
    assert not np.isclose(one[0]["loss"], without[0]["loss"])


def test_merge_gives_a_module_with_the_trained_weights_in_eval_mode(reference):
    net, trainer, state, _ = reference
    evaluator = jt.make_eval_step(net.eval_fn, mesh=1)
    sums = jax.device_get(evaluator(state, BATCHES[0]))
    trained = net.merge(state)
    trained.eval()
    logits = trained(jnp.asarray(BATCHES[0]["image"]))
    np.testing.assert_allclose(sums["accuracy"], np.sum(np.argmax(logits, -1) == BATCHES[0]["label"]))
    np.testing.assert_allclose(np.asarray(trained.bn.mean[...]), jax.device_get(state.model_state["bn"]["mean"]))


def test_eval_without_per_example_is_a_clear_error():
    net = jt.from_nnx(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), loss=lambda out, b: (out.sum(), {}))
    with pytest.raises(TypeError, match="per_example=fn"):
        net.eval_fn(net.params, net.model_state, {"image": jnp.ones((1, 2))})
