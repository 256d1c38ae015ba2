"""Fine-tuning's optimizer (frozen parameters, per-group learning rates: jaxtrain.core.optim) under every strategy
and sharding, held to the independent reference step, and what it means checked by hand."""

import functools

import jax
import numpy as np
import pytest
from conftest import random_batch
from reference import assert_matches
from tolerance import assert_state_reassociated

import jaxtrain as jt
from jaxtrain.core import optim
from jaxtrain.errors import ConfigError
from jaxtrain.models import lenet

BATCHES = [random_batch(64, seed=s) for s in range(3)]
FREEZE, GROUPS = r"^conv1/", ((r"^dense2/", 0.05),)  # the first conv frozen, the classifier at 10x
SETTINGS = {"sgd": dict(name="momentum", lr=0.005), "adam": dict(name="adam", lr=1e-3, clip_grad_norm=1.0)}


def make_tx(opt: str):
    return optim.make_optimizer(**SETTINGS[opt], freeze=FREEZE, lr_groups=GROUPS)


def init_params():
    return lenet.init_params(jax.random.key(0), scale=0.1)


def train(opt: str, mesh=1, **kw):
    trainer = jt.make_train_step(lenet.loss_fn, make_tx(opt), mesh=mesh, **kw)
    state = trainer.init(init_params())
    history = []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


@functools.cache
def reference_for(opt: str):
    """The 1-device run, held to the independent reference step with the same optimizer (and float64)."""
    state, history = train(opt)
    exact = assert_matches(state, history, lenet.loss_fn, make_tx(opt), init_params(), BATCHES)
    return state, history, exact


CASES = ([(s, "replicated", 2) for s in ("jit", "explicit", "shard_map", "pmap", "ring")]
         + [(s, "fsdp", 2) for s in ("jit", "explicit", "shard_map", "ring")]
         + [(s, "zero1", 2) for s in ("jit", "shard_map")])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("strategy, sharding, n", CASES)
def test_fine_tuning_under_every_strategy_and_sharding_equals_the_reference(opt, strategy, sharding, n):
    ref_state, ref_history, exact = reference_for(opt)
    state, history = train(opt, n, strategy=strategy, param_sharding=sharding)
    assert_state_reassociated(jax.device_get(state), history, jax.device_get(ref_state), ref_history, exact)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_frozen_parameters_never_move_and_have_no_optimizer_state(opt):
    state, _ = reference_for(opt)[:2]
    start, after = jax.device_get(init_params()), jax.device_get(state.params)
    np.testing.assert_array_equal(after["conv1"]["w"], start["conv1"]["w"])
    np.testing.assert_array_equal(after["conv1"]["b"], start["conv1"]["b"])
    assert not np.allclose(after["conv2"]["w"], start["conv2"]["w"])
    shapes = {leaf.shape for leaf in jax.tree.leaves(state.opt_state)}
    assert start["conv1"]["w"].shape not in shapes  # no moment, no trace of conv1's weights anywhere
    assert start["conv2"]["w"].shape in shapes


def test_a_group_learns_at_its_own_rate():
    """Plain SGD, one step, by hand: the classifier moves by 0.05 x its gradient, the rest by 0.005 x theirs."""
    tx = optim.make_optimizer("sgd", 0.005, freeze=FREEZE, lr_groups=GROUPS)
    trainer = jt.make_train_step(lenet.loss_fn, tx, mesh=1)
    state, _ = trainer(trainer.init(init_params()), BATCHES[0])
    params = jax.device_get(init_params())
    grads = jax.grad(lambda p: lenet.loss_fn(p, {}, BATCHES[0], None)[0])(params)
    after = jax.device_get(state.params)
    for layer, lr in (("dense2", 0.05), ("dense1", 0.005), ("conv2", 0.005), ("conv1", 0.0)):
        np.testing.assert_allclose(after[layer]["w"], params[layer]["w"] - lr * grads[layer]["w"], rtol=1e-5,
                                   atol=1e-7, err_msg=layer)
    assert float(optim.learning_rate(state.opt_state)) == pytest.approx(0.005)  # the base group's


def test_bad_groups_are_one_line_naming_the_parameters():
    params = init_params()
    assert optim.check_groups(params, r"^conv9/", ()) == [
        "freeze: '^conv9/' matches no parameter (they are named like conv1/b, conv1/w, conv2/b)"]
    assert optim.check_groups(params, ".*", ()) == ["freeze: '.*' matches every parameter: nothing would train"]
    assert optim.check_groups(params, None, (("dense[", 0.1),))[0].startswith(
        "lr_groups: 'dense[' is not a regular expression (")
    from jaxtrain.driver.config import lr_groups

    assert lr_groups("dense2/=1e-2, conv.*=1e-4") == (("dense2/", 0.01), ("conv.*", 1e-4))
    assert lr_groups(None) == lr_groups("") == ()
    with pytest.raises(ConfigError, match=r"lr_groups='dense2/=fast': give REGEX=LR items .* 'dense2/=fast' is not"):
        lr_groups("dense2/=fast")


def test_the_command_line_freezes_and_groups_and_refuses_a_regex_that_matches_nothing(tmp_path):
    from conftest import run_cli

    from jaxtrain import models
    from jaxtrain.driver import export

    args = ["-m", "experiments.lenet", "--devices", "2", "--train-subset", "512", "--test-subset", "256",
            "--max-steps", "2", "--no-progress"]
    run = run_cli(*args, "--freeze", "^conv1/", "--lr-groups", "dense2/=0.5", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-3000:]
    meta, params, _ = export.load(tmp_path / "run")
    start = jax.device_get(jax.jit(models.get("lenet").init)(jax.random.key(0))[0])  # as the run makes it
    np.testing.assert_array_equal(params["conv1"]["w"], start["conv1"]["w"])  # frozen: not a bit moved
    assert not np.allclose(params["conv2"]["w"], start["conv2"]["w"])
    assert (meta["settings"]["freeze"], meta["settings"]["lr_groups"]) == ("^conv1/", "dense2/=0.5")
    bad = run_cli(*args, "--freeze", "^conv9/")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "python -m experiments.lenet: error: freeze: '^conv9/' matches no parameter (they are named like conv1/b, "
        "conv1/w, conv2/b)")
