"""The host loop: no deadlock, exact evaluation, learning on real data."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import needs_fashion_mnist

import jaxtrain as jt
from jaxtrain.data import loader, sources
from jaxtrain.errors import ConfigError, Diverged
from jaxtrain.models import lenet
from jaxtrain.train.loop import evaluate, fit


def random_split(n, seed=0):
    rng = np.random.default_rng(seed)
    return sources.Split(rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int32))


def test_300_steps_on_2_devices_finish_without_deadlock():
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.2), mesh=2)
    evaluator = jt.make_eval_step(lenet.eval_fn, mesh=2)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    train = loader.Loader(random_split(1024), 64, train=True)  # batch 64: the count of steps is what matters
    test = loader.Loader(random_split(300, seed=1), 64, train=False)
    epochs = []
    state, history, first_loss = fit(trainer, state, train, evaluator, test, epochs=100, max_steps=300,
                                     on_epoch=epochs.append, progress=False)
    assert int(state.step) == 300 == sum(h.steps for h in history)
    assert len(history) == len(epochs) == 19  # 18 full epochs of 16 steps + 12 steps
    assert all(h.test_examples == 300 for h in history)
    assert np.isfinite(first_loss) and np.isfinite(history[-1].train_loss)


@pytest.mark.parametrize("n, batch", [(1, 256), (2, 128), (4, 384)])
def test_evaluate_counts_every_example_once(n, batch):
    split = random_split(1000, seed=2)
    params = lenet.init_params(jax.random.key(1), scale=0.1)
    state = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=n).init(params)
    result = evaluate(jt.make_eval_step(lenet.eval_fn, mesh=n), state,
                      loader.Loader(split, batch, train=False).epoch(0))
    assert result["count"] == 1000
    logits = np.asarray(lenet.apply(params, loader.normalise(split.images)))
    np.testing.assert_allclose(result["accuracy"], (logits.argmax(-1) == split.labels).mean(), rtol=1e-6)


@needs_fashion_mnist
def test_short_real_data_run_learns(tfds_dir):
    train_split = sources.load_split("fashion_mnist", "train", tfds_dir=tfds_dir)
    test_split = sources.load_split("fashion_mnist", "test", tfds_dir=tfds_dir)
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.2), mesh=2)
    evaluator = jt.make_eval_step(lenet.eval_fn, mesh=2)
    # A larger init than d2l's 0.01 skips its early plateau, so 150 steps suffice.
    state = trainer.init(lenet.init_params(jax.random.key(0), scale=0.1))
    test = loader.Loader(test_split, 500, train=False)
    before = evaluate(evaluator, state, test.epoch(0))
    state, history, first_loss = fit(trainer, state, loader.Loader(train_split, 256, train=True), evaluator, test,
                                     epochs=1, max_steps=150, progress=False)
    after = history[-1]
    assert before["count"] == after.test_examples == 10000
    assert before["accuracy"] < 0.2 and after.test_acc > 0.6, (before, after)
    assert after.train_loss < first_loss


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_no_recompilation_after_the_first_epoch(strategy):
    """Epoch 1 compiles the train and eval steps; epochs 2-3 (incl. a short last batch of eval) compile nothing."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.2), mesh=2, strategy=strategy, accum_steps=2)
    evaluator = jt.make_eval_step(lenet.eval_fn, mesh=2, strategy=strategy)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    train = loader.Loader(random_split(1024), 256, train=True)
    test = loader.Loader(random_split(300, seed=1), 256, train=False)
    per_epoch = []
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fit(trainer, state, train, evaluator, test, epochs=3, progress=False,
            on_epoch=lambda _: per_epoch.append(len(compiles)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert per_epoch[0] > 0, "the listener saw no compilation at all"
    assert per_epoch[2] == per_epoch[0], per_epoch


def _nan_on_step(n):
    """An optax update that is NaN at step ``n`` (1-based) only: every loss read before it is finite."""
    def update(updates, count, params=None):
        bad = jnp.where(count + 1 == n, jnp.nan, 0.0)
        return jax.tree.map(lambda u: u + bad, updates), count + 1

    return optax.chain(optax.sgd(0.1), optax.GradientTransformation(lambda p: jnp.zeros([], jnp.int32), update))


def test_a_run_whose_last_update_is_not_finite_diverges():
    """(issue 64) --lr 1e6 for 2 steps: the losses read were finite, the final params NaN; the run exited 0."""
    trainer = jt.make_train_step(lenet.loss_fn, _nan_on_step(2), mesh=1)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    with pytest.raises(Diverged, match="the parameters became NaN or infinite at step 2: training diverged"):
        fit(trainer, state, loader.Loader(random_split(256), 64, train=True), None, None, epochs=1, max_steps=2,
            progress=False)


def test_a_non_finite_evaluation_diverges():
    """(issue 64) A NaN evaluation loss was written as test_loss null, exit 0, a sweep's best trial."""
    def eval_fn(params, model_state, batch):
        metrics = lenet.eval_fn(params, model_state, batch)
        return {**metrics, "loss": metrics["loss"] * jnp.nan}

    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=1)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    with pytest.raises(Diverged, match="the evaluation's loss became nan at step 2: training diverged"):
        fit(trainer, state, loader.Loader(random_split(256), 64, train=True), jt.make_eval_step(eval_fn, mesh=1),
            loader.Loader(random_split(64, seed=1), 64, train=False), epochs=1, max_steps=2, progress=False)


def test_a_label_outside_the_classes_in_a_later_batch_stops_fit_in_one_line():
    """(issue 64) Only the first batch's labels were read: a later label of 10 trained on to a NaN loss, then said
    as a divergence ("a learning rate too high?")."""
    split = random_split(256)
    split.labels[200] = 10
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=1)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    with pytest.raises(ConfigError, match=r"^1\.6% of the labels of the batch of step [1-4] are outside the model's "
                                          r"classes: .*; fix the labels$"):
        fit(trainer, state, loader.Loader(split, 64, train=True), None, None, epochs=1, progress=False)


def test_a_label_outside_the_classes_in_the_evaluation_set_is_one_line_not_a_divergence():
    """Its NaN loss ended the run as "diverged" (exit 3, "lower lr="): it is the labels' ConfigError (exit 2); a
    padding row never counts (test_call_checks)."""
    test = random_split(100, seed=1)
    test.labels[37] = -1
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=1)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    with pytest.raises(ConfigError, match=r"^1\.0% of the labels of the evaluation set are outside the model's "
                                          r"classes: .*; fix the labels$") as raised:
        fit(trainer, state, loader.Loader(random_split(256), 64, train=True), jt.make_eval_step(lenet.eval_fn, mesh=1),
            loader.Loader(test, 64, train=False), epochs=1, max_steps=1, progress=False)
    assert not isinstance(raised.value, Diverged) and raised.value.EXIT_CODE == 2


def test_a_label_outside_the_classes_in_the_runs_last_batch_stops_fit():
    """The last step has no later step to read it: fit checks it at the epoch's end (max_steps ends it here)."""
    split = random_split(256)
    split.labels[loader.epoch_order(256, 0, 1)[64 + 5]] = 10  # a row of epoch 1's second batch
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=1)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    with pytest.raises(ConfigError, match=r"^1\.6% of the labels of the batch of (step|call) 2 are outside "):
        fit(trainer, state, loader.Loader(split, 64, train=True), None, None, epochs=1, max_steps=2, progress=False)
