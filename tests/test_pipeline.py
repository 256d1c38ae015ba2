"""Input pipeline: grain loader order/sharding, prefetch_to_device, data wait, transfer guard."""

import threading
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from conftest import needs_fashion_mnist
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.data import loader, sources
from jaxtrain.data.prefetch import prefetch_to_device
from jaxtrain.models import lenet
from jaxtrain.train import timing
from jaxtrain.train.loop import device_batches, evaluate, fit


def numbered_split(n):
    """Image i is filled with i % 251 and labelled i: batches reveal which examples they hold."""
    images = ((np.arange(n, dtype=np.int64) % 251).astype(np.uint8)[:, None, None, None]
              * np.ones((1, 28, 28, 1), np.uint8))
    return sources.Split(images, np.arange(n, dtype=np.int32), num_classes=n)  # a class per example: its id


def ids(batches):
    return np.concatenate([np.asarray(b["label"]) for b in batches])


def test_epoch_order_depends_only_on_seed_and_epoch_and_covers_each_example_once():
    split = numbered_split(1000)
    train = loader.Loader(split, 96, train=True, seed=7, process_count=1, process_index=0)
    first = ids(train.epoch(3))
    assert len(first) == 10 * 96 and len(set(first.tolist())) == len(first)  # at most once; 40 dropped
    np.testing.assert_array_equal(first, loader.epoch_order(1000, 7, 3)[:960])
    np.testing.assert_array_equal(first, ids(train.epoch(3)))
    np.testing.assert_array_equal(first, ids(loader.Loader(split, 96, train=True, seed=7, workers=3).epoch(3)))
    assert not np.array_equal(first, ids(train.epoch(4)))
    # Resuming mid-epoch continues with exactly the batches that were left.
    np.testing.assert_array_equal(ids(train.epoch(3, start=4)), first[4 * 96:])


@pytest.mark.parametrize("processes", [2, 4])
def test_simulated_processes_get_disjoint_shards_covering_the_epoch(processes):
    split = numbered_split(1000)
    shards = [ids(loader.Loader(split, 96, train=True, seed=1, process_index=p, process_count=processes).epoch(0))
              for p in range(processes)]
    for a in range(processes):
        for b in range(a + 1, processes):
            assert not set(shards[a]) & set(shards[b])
    assert sorted(np.concatenate(shards).tolist()) == sorted(loader.epoch_order(1000, 1, 0)[:960].tolist())
    # Process p holds the p-th slice of every global batch (what its devices hold).
    one = loader.Loader(split, 96, train=True, seed=1, process_count=1, process_index=0)
    np.testing.assert_array_equal(next(one.epoch(0))["label"][: 96 // processes], shards[0][: 96 // processes])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_device_batches_are_the_same_global_batches_for_any_device_count(n):
    split = numbered_split(512)
    mesh = jt.make_mesh(n)
    host = list(loader.Loader(split, 64, train=True, seed=2).epoch(0))
    with prefetch_to_device(loader.Loader(split, 64, train=True, seed=2).epoch(0), jt.Plan(mesh).shard, size=2) as it:
        got = list(it)
    assert len(got) == len(host) == 8
    for h, d in zip(host, got):
        assert d["image"].sharding.spec == P(jt.DATA_AXIS) and d["image"].sharding.mesh.devices.size == n
        np.testing.assert_array_equal(jax.device_get(d["label"]), h["label"])
        np.testing.assert_array_equal(jax.device_get(d["image"]), h["image"])


def test_loader_exception_surfaces_right_after_the_batches_before_it_and_threads_stop():
    def broken():
        for i in range(3):
            yield {"image": np.zeros((4, 28, 28, 1), np.float32), "label": np.full(4, i, np.int32)}
        raise RuntimeError("disk on fire")

    it = prefetch_to_device(broken(), jt.Plan(jt.make_mesh(2)).shard, size=2)
    got, errors = [], []

    def consume():
        try:
            for batch in it:
                got.append(int(batch["label"][0]))
        except RuntimeError as e:
            errors.append(e)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    # A safety net only (a lost exception blocks next() forever): the consumer takes milliseconds.
    consumer.join(timeout=60)
    assert not consumer.is_alive(), "the loader's exception never reached the consumer"
    assert got == [0, 1, 2] and len(errors) == 1 and "disk on fire" in str(errors[0])  # the next call after them
    assert not it.running


def test_early_exit_leaves_no_thread_running():
    split = numbered_split(4096)
    before = {t for t in threading.enumerate() if t.name == "jaxtrain-prefetch"}
    it = prefetch_to_device(loader.Loader(split, 64, train=True).epoch(0), jt.Plan(jt.make_mesh(2)).shard, size=2)
    for i, _ in enumerate(it):
        if i == 2:
            break
    it.close()
    assert not it.running
    assert {t for t in threading.enumerate() if t.name == "jaxtrain-prefetch" and t.is_alive()} <= before


def test_a_grain_without_its_unlinking_thread_is_said_once_not_silently_unawaited(monkeypatch, caplog):
    """grain 0.2.18 has no public way to wait for its unlinking thread: the loader waits on a private attribute.
    A grain without it is one warning line per process (resource_tracker may warn at exit), not silence."""
    monkeypatch.delattr(loader.SharedMemoryArray, "_del_thread_pool")
    loader._cannot_await_shared_memory.cache_clear()
    try:
        for _ in range(3):  # each Loader.close, and at exit
            loader._give_back_shared_memory()
    finally:
        loader._cannot_await_shared_memory.cache_clear()
    said = [r for r in caplog.records if r.name == "jaxtrain.data.loader"]
    assert len(said) == 1 and said[0].levelname == "WARNING", said
    assert said[0].getMessage().startswith("the shared memory of the batches let go cannot be awaited: grain "), said
    assert "has no _del_thread_pool" in said[0].getMessage() and "resource_tracker" in said[0].getMessage()
    monkeypatch.undo()  # grain's attribute back: waited for, nothing said
    caplog.clear()
    loader._give_back_shared_memory()
    assert not [r for r in caplog.records if r.name == "jaxtrain.data.loader"]


def make_run(n=2):
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=n)
    evaluator = jt.make_eval_step(lenet.eval_fn, mesh=n)
    return trainer, evaluator, trainer.init(lenet.init_params(jax.random.key(0)))


def test_slow_loader_shows_up_as_data_wait_and_workers_build_batches_at_once(monkeypatch):
    """What a busy machine cannot change: the loop's wait for a slow batch is counted, and worker threads run the
    transform concurrently. How much they hide is timed by ``python -m experiments.input_pipeline --slow-ms 100``.
    No sleeps and no real clock: the loop's clock is the test's, and the workers wait on each other."""
    numbered = numbered_split(64 * 16)
    split = sources.Split(numbered.images, numbered.labels % 10)  # labels in the classes: a finite loss
    trainer, evaluator, state = make_run()
    test = loader.Loader(sources.Split(split.images[:64], split.labels[:64]), 64, train=False)

    # No workers, no prefetch: each batch is built in the loop's own wait, on a clock that building one advances
    # by 0.1 s. The first wait is the loader's start (its iterator starting: start_up_sec, as a folder's worker
    # processes starting would be), the other 15 x 0.1 s are waiting for data; a wait left uncounted is neither.
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    seen = []

    def slow(batch):
        seen.append(threading.current_thread())
        now[0] += 0.1
        return batch

    train = loader.Loader(split, 64, train=True, transform=slow, workers=0)
    state, history, _ = fit(trainer, state, train, evaluator, test, epochs=1, progress=False, prefetch=0)
    assert history[0].steps == 16 and history[0].data_wait_sec == pytest.approx(15 * 0.1), history[0]
    assert history[0].start_up_sec == pytest.approx(0.1), history[0]
    assert set(seen) == {threading.current_thread()}  # built one at a time, in the loop's thread
    monkeypatch.undo()

    # 8 workers: the first batch's build waits until a second one has started, which only a second worker can
    # start. Built one at a time, the wait ends at its deadline and the test fails on ``overlapped``.
    second, started, overlapped = threading.Event(), [], []

    def waits_for_another(batch):
        with lock:
            started.append(batch)
            first = len(started) == 1
        if first:
            overlapped.append(second.wait(timeout=120))
        else:
            second.set()
        return batch

    lock = threading.Lock()
    train = loader.Loader(split, 64, train=True, transform=waits_for_another, workers=8)
    state, history, _ = fit(trainer, state, train, evaluator, test, epochs=1, progress=False, prefetch=2)
    assert history[0].steps == 16 and overlapped == [True], overlapped


@needs_fashion_mnist
def test_default_pipeline_on_real_data_keeps_the_wait_low_and_counts_every_test_example(tfds_dir):
    train_split = sources.load_split("fashion_mnist", "train", tfds_dir=tfds_dir)
    test_split = sources.load_split("fashion_mnist", "test", tfds_dir=tfds_dir)
    trainer, evaluator, state = make_run()
    train = loader.Loader(train_split, 256, train=True)
    state, history, _ = fit(trainer, state, train, evaluator, loader.Loader(test_split, 256, train=False), epochs=1,
                            max_steps=60, progress=False)
    assert history[0].steps == 60  # its data wait is timed by python -m experiments.input_pipeline
    # Every test example exactly once, for a batch that leaves a ragged end on 4 devices.
    four = jt.make_eval_step(lenet.eval_fn, mesh=4)
    state4 = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4).init(jax.device_get(state.params))
    result = evaluate(four, state4, loader.Loader(test_split, 384, train=False).epoch(0))
    assert result["count"] == 10000
    assert abs(result["accuracy"] - history[0].test_acc) < 1e-6  # same params, other batch and device count


def test_host_array_inside_the_guarded_loop_raises():
    trainer, _, state = make_run()
    host = {"image": np.zeros((64, 28, 28, 1), np.float32), "label": np.zeros(64, np.int32)}
    trainer(state, host)  # outside the loop the trainer shards (explicit copies): fine
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="[Dd]isallowed"):
        trainer.step(state, host)
    # ... while device batches from the pipeline pass.
    batch = next(iter(device_batches([host], trainer.batch_plan, prefetch=0)))
    with jax.transfer_guard("disallow"):
        trainer.step(state, batch)
