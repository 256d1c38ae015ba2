"""A linear probe (``--linear-probe``, ``jaxtrain.models.classify.linear_probe``): the classifier trains on the
model's evaluation-mode features, the rest frozen, BatchNorm on its running statistics, which keep every bit (on
3 devices too, where an average over the devices would round them); under every strategy and sharding, held to
the independent reference step."""

import functools

import jax
import numpy as np
import pytest
from conftest import random_batch
from reference import assert_matches
from tolerance import assert_state_reassociated

import jaxtrain as jt
from jaxtrain import models
from jaxtrain.core import optim
from jaxtrain.models import classify

MODEL = models.get("resnet18", init="he", conv="xla", input_shape=(12, 12, 1))  # d2l's: BatchNorm in every block
PROBE = classify.linear_probe(MODEL)
BATCHES = [{**b, "image": b["image"][:, :12, :12]} for b in (random_batch(12, seed=s) for s in range(2))]


def make_tx():
    return optim.make_optimizer("momentum", 0.05, freeze=f"^(?!{MODEL.classifier})")


@functools.cache
def start():
    """He-initialised weights and BatchNorm statistics drawn at random (evaluation mode is then no identity),
    the statistics Frozen as the probe carries them."""
    params, frozen = jax.device_get(PROBE.init(jax.random.key(0)))
    leaves, tree = jax.tree.flatten(frozen)
    rng = np.random.default_rng(0)
    drawn = [rng.uniform(0.5, 2.0, x.shape).astype(x.dtype) if i % 2 else rng.normal(0, 0.2, x.shape).astype(x.dtype)
             for i, x in enumerate(leaves)]  # flax's BatchStat leaves come as (mean, var) pairs
    return params, jax.tree.unflatten(tree, drawn)


def train(mesh=1, **kw):
    trainer = jt.make_train_step(PROBE.loss_fn, make_tx(), mesh=mesh, **kw)
    variables = start()  # made outside the trainer's traced init
    state = trainer.init(init_fn=lambda rng: variables, rng=jax.random.key(0))
    history = []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


@functools.cache
def reference_run():
    state, history = train()
    exact = assert_matches(state, history, PROBE.loss_fn, make_tx(), start()[0], BATCHES, model_state=start()[1])
    return state, history, exact


CASES = ([(s, "replicated", 2) for s in ("jit", "explicit", "shard_map", "pmap", "ring")]
         + [(s, "replicated", 3) for s in ("shard_map", "pmap")]  # an average over 3 devices would round
         + [(s, "fsdp", 2) for s in ("jit", "shard_map")] + [("jit", "zero1", 2)])
CASES = [CASES[5]] + [pytest.param(*case, marks=pytest.mark.slow) for case in CASES[:5] + CASES[6:]]  # newest: one


@pytest.mark.parametrize("strategy, sharding, n", CASES)
def test_a_linear_probe_under_every_strategy_and_sharding_equals_the_reference(strategy, sharding, n):
    ref_state, ref_history, exact = reference_run()
    state, history = train(n, strategy=strategy, param_sharding=sharding)
    assert_state_reassociated(jax.device_get(state), history, jax.device_get(ref_state), ref_history, exact)
    stats = jax.device_get(state.model_state)
    jax.tree.map(np.testing.assert_array_equal, stats, start()[1])  # every statistic as it was, every bit


def test_only_the_classifier_moves_and_the_backbone_keeps_every_bit():
    state = jax.device_get(reference_run()[0])
    before = start()[0]
    moved = {"/".join(str(getattr(k, "key", k)) for k in path): not np.array_equal(a, b) for (path, a), b in
             zip(jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(before))}
    assert {name for name, m in moved.items() if m} == {"dense/bias", "dense/kernel"}
    assert len(moved) > 40
    jax.tree.map(np.testing.assert_array_equal, state.model_state, start()[1])


def test_the_probe_runs_the_model_in_evaluation_mode():
    """The probe's logits are the model's evaluation-mode logits over the statistics it carries; its train loss is
    the cross-entropy of those (not of the training-mode network's)."""
    params, frozen = start()
    images = BATCHES[0]["image"]
    np.testing.assert_array_equal(PROBE.logits(params, frozen, images), MODEL.logits(params, frozen.tree, images))
    loss, (state, _) = PROBE.loss_fn(params, frozen, BATCHES[0], None)
    train_mode, _ = MODEL.loss_fn(params, frozen.tree, BATCHES[0], None)
    assert state is frozen and float(loss) != pytest.approx(float(train_mode))


def test_the_command_line_probes_and_refuses_it_beside_freeze(tmp_path):
    from conftest import run_cli

    from jaxtrain.driver import export

    args = ["-m", "experiments.resnet18", "--devices", "2", "--train-subset", "64", "--test-subset", "64",
            "--batch-size", "32", "--max-steps", "2", "--no-progress"]
    run = run_cli(*args, "--linear-probe", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    meta, params, stats = export.load(tmp_path / "run")
    start_params, start_stats = jax.device_get(jax.jit(models.get("resnet18").init)(jax.random.key(0)))
    jax.tree.map(np.testing.assert_array_equal, stats, start_stats)  # BatchNorm's statistics never updated
    np.testing.assert_array_equal(params["blocks"][3]["conv2"]["kernel"], start_params["blocks"][3]["conv2"]["kernel"])
    assert not np.array_equal(params["dense"]["kernel"], start_params["dense"]["kernel"])
    assert meta["settings"]["linear_probe"] is True
    bad = run_cli(*args, "--linear-probe", "--freeze", "^conv/")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "python -m experiments.resnet18: error: --linear-probe with --freeze '^conv/': a linear probe freezes all but "
        "the classifier itself; give one of them")
