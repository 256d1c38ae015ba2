"""jaxtrain.nn.batch_stats: BatchNorm's statistics over the step's whole batch with one collective each way, held to
the plain 1-device reference under every strategy, sharding, mesh and accumulation mode.

The network here has softplus where ResNet has ReLU: a ReLU flips on a re-association of its input, so two exact
computations of its gradient may differ by 1e-5 (tests/test_resnet.py, ``three_steps``); softplus does not."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_batch
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.models import classify
from jaxtrain.models.resnet import batch_norm
from jaxtrain.nn import batch_stats
from reference import assert_matches

BATCHES = [random_batch(16, seed=s) for s in range(3)]


class Net(nnx.Module):
    """Two conv + BatchNorm (jaxtrain's statistics, or flax's) + softplus layers, a dense layer split by
    tensor parallelism where the mesh has "model"."""

    def __init__(self, stats: str, rngs: nnx.Rngs):
        self.conv1, self.bn1 = nnx.Conv(1, 8, (3, 3), rngs=rngs), batch_norm(8, rngs, stats)
        self.conv2, self.bn2 = nnx.Conv(8, 16, (3, 3), strides=2, rngs=rngs), batch_norm(16, rngs, stats)
        self.out = nnx.Linear(16, 10, rngs=rngs,
                              kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")))

    def __call__(self, x):
        x = jax.nn.softplus(self.bn1(self.conv1(x)))
        x = jax.nn.softplus(self.bn2(self.conv2(x)))
        return self.out(x.mean((1, 2)))


def adapter(stats="jaxtrain"):
    with nnx.use_eager_sharding(False):
        model = Net(stats, nnx.Rngs(0))
    return jt.from_nnx(model, loss=lambda logits, b: classify.mean_loss(logits, b["label"]))


def train(mesh, stats="jaxtrain", **kw):
    net = adapter(stats)
    trainer = jt.make_train_step(net.loss_fn, optax.sgd(0.1), mesh=mesh, **kw)
    state, history = trainer.init(net.params, net.model_state), []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(metrics)
    return net, trainer, state, history


def _matches(net, state, history, **kw):
    assert_matches(state, history, net.loss_fn, optax.sgd(0.1), net.params, BATCHES, model_state=net.model_state,
                   **kw)


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_every_strategy_on_two_devices_equals_the_reference(strategy):
    net, _, state, history = train(2, strategy=strategy)
    _matches(net, state, history)
    assert not np.allclose(jax.device_get(state.model_state["bn2"]["var"]), 1.0)  # the statistics moved


@pytest.mark.parametrize("strategy,sharding", [("jit", "fsdp"), ("jit", "zero1"), ("shard_map", "fsdp")])
def test_sharded_state_equals_the_reference(strategy, sharding):
    net, _, state, history = train(2, strategy=strategy, param_sharding=sharding)
    _matches(net, state, history)


def test_a_model_traced_with_explicit_axes_equals_the_reference():
    net, _, state, history = train(2, strategy="explicit", model_axes="explicit")
    _matches(net, state, history)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_accumulated_micro_batches_equal_the_reference(strategy):
    net, _, state, history = train(2, strategy=strategy, accum_steps=2)
    _matches(net, state, history, accum_steps=2)


@pytest.mark.parametrize("axes", [{"data": 2, "model": 2}, {"replica": 2, "data": 2}])
def test_tensor_parallel_and_hybrid_meshes_equal_the_reference(axes):
    net, _, state, history = train(jt.make_mesh(4, axes))
    _matches(net, state, history)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_beyond_max_devices_the_statistics_are_flaxs(monkeypatch, strategy):
    """Past ``MAX_DEVICES`` (the gathered rows grow with the devices) BatchNorm keeps flax's statistics:
    the step then equals the same network with flax's, bit for bit."""
    monkeypatch.setattr(batch_stats, "MAX_DEVICES", 1)
    _, _, state, history = train(2, strategy=strategy)
    _, _, want, want_history = train(2, "flax", strategy=strategy)
    chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(want.params))
    chex.assert_trees_all_equal(jax.device_get(history), jax.device_get(want_history))


def test_one_all_reduce_each_way_where_flax_takes_two():
    """The compiled 2-device step: flax's statistics take 2 all-reduces per BatchNorm forward and 2 backward;
    jaxtrain's 1 and 1 (the gradients' own reduction is one more in both)."""
    counts = {}
    for stats in ("flax", "jaxtrain"):
        net = adapter(stats)
        trainer = jt.make_train_step(net.loss_fn, optax.sgd(0.1), mesh=2)
        state = trainer.init(net.params, net.model_state)
        counts[stats] = trainer.lower(state, BATCHES[0]).compile().as_text().count(" all-reduce(")
    assert counts == {"flax": 4 * 2 + 1, "jaxtrain": 2 * 2 + 1}, counts


@pytest.mark.parametrize("check_vma", [True, False])
def test_moments_of_the_shares_are_the_whole_arrays_with_its_gradient(check_vma):
    """Inside shard_map (checked, and unchecked as the ring strategy runs): the moments over both devices'
    shares, and their gradient, equal those of the whole array's two passes."""
    mesh = jt.make_mesh(2)
    x = 3.0 + jax.random.normal(jax.random.key(0), (8, 5, 5, 4))  # a mean away from 0

    def loss(mean, var):
        return jnp.sum(jnp.sin(mean) * var) + jnp.sum(var ** 2)

    def over_devices(x):
        def local(x):
            return loss(*batch_stats.moments(x, (0, 1, 2), "data")) / 2  # each device's half of the loss

        per_device = jax.shard_map(lambda x: jax.lax.psum(local(x), "data"), mesh=mesh, in_specs=P("data"),
                                   out_specs=P(), check_vma=check_vma)
        return per_device(x)

    def whole(x):
        mean = x.mean((0, 1, 2))
        return loss(mean, jnp.square(x - mean).mean((0, 1, 2)))

    np.testing.assert_allclose(jax.jit(over_devices)(x), whole(x), rtol=1e-6)
    chex.assert_trees_all_close(jax.jit(jax.grad(over_devices))(x), jax.grad(whole)(x), rtol=1e-5, atol=1e-6)
    assert not batch_stats.split(x, (0, 1, 2))  # outside a step: one device's statistics (flax's, in BatchNorm)
