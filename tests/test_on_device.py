"""A split on the devices gives the host Loader's batches bit for bit: images, labels, crop/flip draws, eval masks."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FASHION_MNIST_DIR, needs_fashion_mnist
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import ConfigError
from jaxtrain.data import augment, idx, loader, on_device
from jaxtrain.data.split import Split
from jaxtrain.parallel.devices import make_mesh
from jaxtrain.parallel.placement import Plan

RNG = np.random.default_rng(0)
SPLIT = Split(RNG.integers(0, 256, (53, 12, 10, 3), dtype=np.uint8), RNG.integers(0, 10, 53).astype(np.int32))


def as_u64(pair) -> np.ndarray:
    high, low = (np.asarray(w).astype(np.uint64) for w in pair)
    return (high << np.uint64(32)) | low


@pytest.mark.parametrize("seed", [0, 3, 2**32 + 1, 2**63, 2**64 - 2, 2**64 - 1, 2**64 + 5, -1])
def test_random_bits_are_numpys_for_any_seed_epoch_and_index(seed):
    large = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**63 + 5, 2**64 - 1]
    index = np.array([*range(1000), *large], np.uint64)
    for epoch in (0, 1, 2, 2**31 - 1, 2**40):
        np.testing.assert_array_equal(as_u64(on_device.random_bits(seed, epoch, index)),
                                      augment.random_bits(seed, epoch, index))
    # traced: int32 indices and epoch, as a scan body has them
    small = np.arange(0, 2**31 - 1, 2**31 // 999 + 1)
    bits = jax.jit(lambda e, i: on_device.random_bits(seed, e, i))(jnp.int32(5), jnp.asarray(small, jnp.int32))
    np.testing.assert_array_equal(as_u64(bits), augment.random_bits(seed, 5, small))


def test_crop_flip_is_numpys_for_batches_of_batches():
    index = RNG.permutation(53)[:48]
    want = augment.crop_flip(SPLIT.images[index], 11, 4, index)
    got = jax.jit(lambda images, i: on_device.crop_flip(images, 11, 4, i))(
        SPLIT.images[index].reshape(6, 8, 12, 10, 3), jnp.asarray(index.reshape(6, 8), jnp.int32))
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)


def mesh_and_shardings(devices: int, split_spec=P()):
    mesh = make_mesh(devices)
    return Plan(mesh), NamedSharding(mesh, split_spec), NamedSharding(mesh, P(None, "data"))


def assert_same_batch(got: dict, want: dict):
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("augment_name", ["none", "crop+flip"])
def test_train_batches_are_the_loaders_bit_for_bit(devices, augment_name):
    plan, replicated, rows = mesh_and_shardings(devices)
    data = on_device.place(SPLIT, replicated)
    host = loader.Loader(SPLIT, 8, train=True, seed=7, augment=augment_name)
    halves = [loader.Loader(SPLIT, 8, train=True, seed=7, augment=augment_name, process_index=p, process_count=2)
              for p in (0, 1)]
    gather = jax.jit(on_device.train_batch, static_argnames=("seed", "augment"),
                     out_shardings=NamedSharding(plan.mesh, P(None, "data")))
    for epoch in (1, 2):
        index = on_device.put(on_device.train_indices(host, epoch, 1, 4), rows)
        got = jax.device_get(gather(data, index, seed=7, epoch=epoch, augment=augment_name))
        for k, b in enumerate(range(1, 5)):
            assert_same_batch({key: v[k] for key, v in got.items()}, host.batch_at(epoch, b))
            for p, half in enumerate(halves):  # each process's rows: what its own loader builds
                assert_same_batch({key: v[k][4 * p:4 * p + 4] for key, v in got.items()}, half.batch_at(epoch, b))


def test_one_batch_at_a_time_in_a_scan_with_the_epoch_traced():
    plan, replicated, rows = mesh_and_shardings(2)
    data = on_device.place(SPLIT, replicated)
    host = loader.Loader(SPLIT, 8, train=True, seed=2**64 - 3, augment="crop+flip")

    @jax.jit
    def images_of(data, indices, epoch):
        def body(total, index):
            batch = on_device.train_batch(data, index, 2**64 - 3, epoch, "crop+flip")
            batch = jax.lax.with_sharding_constraint(batch, plan.batch)
            return total + batch["image"].sum(), (batch["image"], batch["label"])

        return jax.lax.scan(body, jnp.float32(0), indices)[1]

    indices = on_device.put(on_device.train_indices(host, 3, 0, len(host)), rows)
    images, labels = jax.device_get(images_of(data, indices, jnp.int32(3)))
    for b in range(len(host)):
        assert_same_batch({"image": images[b], "label": labels[b]}, host.batch_at(3, b))


@pytest.mark.parametrize("devices", [1, 2])
def test_the_whole_evaluation_in_one_call_is_the_loaders_padding_and_mask_included(devices):
    plan, replicated, _ = mesh_and_shardings(devices)
    data = on_device.place(SPLIT, replicated)
    host = loader.Loader(SPLIT, 12, train=False, augment="crop+flip")  # never on evaluation batches
    gather = jax.jit(on_device.eval_batch, static_argnames="batch_size",
                     out_shardings=NamedSharding(plan.mesh, P(None, "data")))
    got = jax.device_get(gather(data, jnp.arange(len(host)), batch_size=12))
    assert len(host) == 5 and got["mask"][-1].sum() == 53 - 48  # the last batch padded
    for b, want in enumerate(host.epoch(0)):
        assert_same_batch({key: v[b] for key, v in got.items()}, want)
    single = jax.device_get(jax.jit(on_device.eval_batch, static_argnames="batch_size")(data, jnp.int32(4), 12))
    assert_same_batch(single, host.batch_at(0, 4))


def test_a_split_sharded_over_data_gives_the_same_batches():
    _, sharded, rows = mesh_and_shardings(2, P("data"))
    split = Split(SPLIT.images[:52], SPLIT.labels[:52])
    data = on_device.place(split, sharded)
    with pytest.raises(ConfigError, match="the 53 examples do not split evenly over the devices"):
        on_device.place(SPLIT, sharded)
    assert data.images.addressable_shards[0].data.shape == (26, 12, 10, 3)  # half the split per device
    host = loader.Loader(split, 8, train=True, seed=1, augment="crop+flip")
    index = on_device.put(on_device.train_indices(host, 0, 0, len(host)), rows)
    got = jax.device_get(jax.jit(on_device.train_batch, static_argnums=(2, 4))(data, index, 1, 0, "crop+flip"))
    for b in range(len(host)):
        assert_same_batch({key: v[b] for key, v in got.items()}, host.batch_at(0, b))


@needs_fashion_mnist
def test_real_fashion_mnist_batches_are_the_loaders():
    plan, replicated, rows = mesh_and_shardings(2)
    train, test = (idx.read_split(FASHION_MNIST_DIR, name) for name in ("train", "test"))
    host = loader.Loader(train, 256, train=True, seed=0, augment="crop+flip")
    data = on_device.place(train, replicated)
    index = on_device.put(on_device.train_indices(host, 1, len(host) - 3, 3), rows)
    got = jax.device_get(jax.jit(on_device.train_batch, static_argnums=(2, 4))(data, index, 0, 1, "crop+flip"))
    for k, b in enumerate(range(len(host) - 3, len(host))):
        assert_same_batch({key: v[k] for key, v in got.items()}, host.batch_at(1, b))
    evaluation = loader.Loader(test, 768, train=False)  # 10,000 = 13 x 768 + 16: the last batch mostly padding
    got = jax.device_get(jax.jit(on_device.eval_batch, static_argnums=2)(on_device.place(test, replicated),
                                                                         jnp.arange(len(evaluation)), 768))
    for b in (0, len(evaluation) - 1):
        assert_same_batch({key: v[b] for key, v in got.items()}, evaluation.batch_at(0, b))


def test_what_cannot_run_on_the_devices_is_a_one_line_error():
    _, replicated, _ = mesh_and_shardings(1)
    with pytest.raises(ConfigError, match="cannot be placed on the devices"):
        on_device.place(types.SimpleNamespace(raw=True), replicated)
    data = on_device.place(SPLIT, replicated)
    with pytest.raises(ConfigError, match="rrc\\+flip crops each image before it is decoded"):
        on_device.train_batch(data, jnp.arange(8), 0, 0, "rrc+flip")
    host = loader.Loader(SPLIT, 8, train=True)
    with pytest.raises(ConfigError, match="batches 5..6 asked for, but an epoch has 6"):
        on_device.train_indices(host, 0, 5, 2)
    with pytest.raises(ConfigError, match="for a training loader"):
        on_device.train_indices(loader.Loader(SPLIT, 8, train=False), 0, 0, 1)
