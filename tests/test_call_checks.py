"""What the trainer checks where a Python user calls it (jaxtrain.parallel.call_checks): labels, batches,
states, mesh axes.

Each mistake is one ConfigError (a ValueError) naming what differs, not a JAX error from deep inside the step.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_batch

import jaxtrain as jt
from jaxtrain.errors import ConfigError
from jaxtrain.models import classify, lenet


def lenet_trainer(tx=None, **kw):
    return jt.make_train_step(lenet.loss_fn, tx or optax.sgd(0.1), mesh=2, **kw)


def lenet_state(trainer):
    return trainer.init(init_fn=lambda rng: (lenet.init_params(rng), {}), rng=jax.random.key(0))


def with_label(batch, value):
    labels = batch["label"].copy()
    labels[3] = value
    return {**batch, "label": labels}


SAYS = r"model's classes \(they range -?\d+\.\.\d+\): .*; fix the labels"


@pytest.mark.parametrize("label", [10, -1])
@pytest.mark.parametrize("entry", ["call", "step"])
def test_a_bad_later_batch_raises_within_two_calls_and_the_raising_call_keeps_its_state(label, entry):
    """Label 10 gave a NaN loss, -1 a plausible 2.30 (it wrapped to class 9). Only the first batch was checked:
    a later batch trained on to a NaN loss (issue 64); trainer.step, the hot-loop entry, checked none but the first.
    Now each call checks, before its step takes its state, every earlier call whose step is done and the call
    before the previous one in any case."""
    trainer = lenet_trainer()
    run = trainer if entry == "call" else lambda s, b: trainer.step(s, trainer.shard(b))
    state = lenet_state(trainer)
    for call in range(1, 4):
        batch = random_batch(8, seed=call)
        state, _ = run(state, with_label(batch, label) if call == 3 else batch)
    for call in (4, 5):  # at most two calls later
        try:
            state, _ = run(state, random_batch(8, seed=call))
        except ConfigError as e:
            assert re.fullmatch(rf"12\.5% of the labels of the batch of call 3 are outside the {SAYS}", str(e)), e
            break
    else:
        pytest.fail("no call raised within two calls of the bad batch")
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))  # the raising call took nothing
    state, metrics = run(state, random_batch(8))
    assert np.isfinite(metrics["loss"])
    trainer.check_labels()  # nothing else pending: each call was checked once


def test_a_bad_batch_whose_step_is_done_raises_at_the_next_call():
    """The next call reads every earlier call whose step is done (``is_ready``: a poll), not only the one two back."""
    trainer = lenet_trainer()
    state, _ = trainer(lenet_state(trainer), random_batch(8))
    state, metrics = trainer(state, with_label(random_batch(8, seed=2), 10))
    jax.block_until_ready(metrics)  # its step is done
    with pytest.raises(ConfigError, match=r"^12\.5% of the labels of the batch of call 2 are outside "):
        trainer(state, random_batch(8, seed=3))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


@pytest.mark.parametrize("entry", ["call", "step"])
def test_a_bad_first_batch_raises_on_its_own_call_saying_its_state_is_gone(entry):
    """The first step waits once (it always did): a single call with bad labels raises, and says that the state it
    was given went to its step (donated), as nothing else would tell a user it cannot be used again."""
    trainer = lenet_trainer()
    run = trainer if entry == "call" else lambda s, b: trainer.step(s, trainer.shard(b))
    state = lenet_state(trainer)
    with pytest.raises(ConfigError, match=rf"^12\.5% of the labels of the batch of call 1 are outside the {SAYS}; "
                                          r"its step ran and consumed \(donated\) the state this call was given: "
                                          r"start again from trainer\.init or a checkpoint$"):
        run(state, with_label(random_batch(8), 10))
    assert any(x.is_deleted() for x in jax.tree.leaves(state))  # as the error says


@pytest.mark.parametrize("last", [2, 1])
def test_bad_labels_in_a_loops_last_call_are_reported_by_check_labels(last):
    """A loop's last calls have no later call to check them: ``check_labels`` waits for them and does (they went
    unreported: the loop ended, exit 0). The next-to-last call's labels are checked by the last call only if its
    step is already done (a call never waits for one): then they are reported there, once, and not again."""
    trainer = lenet_trainer()
    state = lenet_state(trainer)
    says = rf"^12\.5% of the labels of the batch of call {6 - last} are outside "
    try:
        for call in range(1, 6):
            batch = random_batch(8, seed=call)
            state, _ = trainer(state, with_label(batch, -1) if call == 6 - last else batch)
    except ConfigError as e:  # call 5 found call 4's step done (a busy machine's timing): reported by the loop
        assert last == 2 and call == 5 and re.match(says, str(e)), (call, e)
    else:
        with pytest.raises(ConfigError, match=says):
            trainer.check_labels()
    trainer.check_labels()  # said once


def test_a_label_outside_the_classes_gives_a_nan_loss_never_a_plausible_one():
    """The bad call itself returns (nothing waits for its step): the loss shows it, and its update is finite."""
    trainer = lenet_trainer()
    state, _ = trainer(lenet_state(trainer), random_batch(8))
    state, metrics = trainer(state, with_label(random_batch(8, seed=1), -1))
    assert np.isnan(metrics["loss"]) and float(metrics[classify.LABELS_OUT_OF_RANGE]) == 1 / 8
    assert np.isfinite(jax.device_get(state.params["dense2"]["w"])).all()  # the good examples' gradients only
    logits = jnp.zeros((3, 10))
    loss = classify.cross_entropy(logits, jnp.array([0, -1, 10]))
    assert np.isfinite(loss[0]) and np.isnan(loss[1:]).all()


@pytest.mark.parametrize(("label", "says"), [
    (lambda b: b["label"].astype(np.float32), r"batch\['label'\] is float32: labels are integer class indices 0\.\.9"),
    (lambda b: b["label"][:, None], r"batch\['label'\] has examples of shape \(1,\): give one integer class index"),
])
def test_labels_of_the_wrong_dtype_or_shape_are_one_line_errors(label, says):
    trainer = lenet_trainer()
    batch = random_batch(8)
    with pytest.raises(ConfigError, match=says):
        trainer(lenet_state(trainer), {**batch, "label": label(batch)})


@pytest.mark.parametrize(("image", "says"), [
    (lambda x: x[..., 0], r"batch\['image'\] has examples of shape \(28, 28\): LeNet takes images \[batch, height, "
                          r"width, channels\] with 1 channel"),
    # uint8 pixels are taken (normalised on the device: tests/test_folder.py); other integers are not
    (lambda x: (x * 255).astype(np.int32), r"batch\['image'\] is int32: LeNet takes float images .* or uint8 pixels"),
])
def test_images_the_model_cannot_take_are_one_line_errors_saying_what_it_takes(image, says):
    trainer = lenet_trainer()
    batch = random_batch(8)
    with pytest.raises(ConfigError, match=says):
        trainer(lenet_state(trainer), {**batch, "image": image(batch["image"])})


def squares_loss(params, model_state, batch, rng):
    return jnp.mean((batch["x"] @ params["w"]) ** 2), (model_state, {})


def test_a_batch_a_users_loss_fn_cannot_take_names_what_differs_from_the_batch_that_ran():
    trainer = jt.make_train_step(squares_loss, optax.sgd(0.1), mesh=2)
    state = trainer.init({"w": jnp.ones((3,))})
    state, _ = trainer(state, {"x": np.ones((4, 3), np.float32)})
    with pytest.raises(ConfigError, match=r"^batch\['x'\] is \(4, 5\) float32 but was \(4, 3\) float32 in the batch "
                                          r"that last ran: the step cannot be traced for it \(TypeError: "):
        trainer(state, {"x": np.ones((4, 5), np.float32)})
    fresh = jt.make_train_step(squares_loss, optax.sgd(0.1), mesh=2)
    with pytest.raises(ConfigError, match=r"^the step cannot be traced for this batch \(x \(4, 5\) float32\): "):
        fresh(fresh.init({"w": jnp.ones((3,))}), {"x": np.ones((4, 5), np.float32)})


@pytest.mark.parametrize(("other", "says"), [
    (dict(tx=optax.adam(1e-3)), r"its opt_state differs \(another optimizer, or accum_steps=\): \(ScaleByAdamState, "
                                r"EmptyState\) in the state, \(EmptyState, EmptyState\) from this trainer"),
    (dict(precision="fp16"), r"its loss_scale differs \(another precision=\)"),
    (dict(param_sharding="fsdp"), r"params/conv2/w is placed P\(None, None, None, 'data'\) on mesh \{'data': 2\} "
                                  r"but this trainer places it P\(\)"),
])
def test_a_state_from_another_trainer_is_one_line_naming_what_differs(other, says):
    """It was a "pytree structure error" or "Sharding passed to jit does not match"; found before compiling."""
    trainer = lenet_trainer()
    state = lenet_state(lenet_trainer(**other))
    with pytest.raises(ConfigError, match="^state does not match this trainer: " + says):
        trainer(state, random_batch(8))


def test_a_mesh_axis_no_rule_uses_is_named_once_in_one_warning_line(capsys):
    from jaxtrain import cli

    """--mesh model=2 with replicated parameters ran 3.6x slower than data=2 and said nothing."""
    mesh = jt.make_mesh(2, axes={"model": 2})
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=mesh)
    with cli.library_log():  # a log warning, as a command line says it
        lenet_state(trainer)
        trainer.layout(lenet.init_params(jax.random.key(0)))
    err = capsys.readouterr().err
    assert err.count("warning: mesh axis 'model' (2 devices) is used by no parameter rule: those devices compute "
                     "the same thing; give them to 'data' (mesh data=N)") == 1, err
    for axes, rules in (({"data": 2}, "replicated"), ({"model": 2}, [(r"dense1/w$", jax.P(None, "model"))])):
        lenet_state(jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(2, axes=axes),
                                       param_sharding=rules))
    assert "warning" not in capsys.readouterr().err


def test_a_padding_row_never_counts_in_evaluation_even_with_a_label_outside_the_classes():
    """Out-of-range labels have a NaN loss now; a masked row (padding, often labelled -1) must still add nothing."""
    evaluator = jt.make_eval_step(lenet.eval_fn, mesh=2)
    state = lenet_state(lenet_trainer())
    batch = random_batch(8)
    padded = {**with_label(batch, -1), "mask": np.array([1, 1, 1, 0, 1, 1, 1, 1], np.float32)}
    sums = jax.device_get(evaluator(state, padded))
    real = jax.device_get(evaluator(state, {**batch, "mask": padded["mask"]}))
    assert sums["count"] == 7 and np.isfinite(sums["loss"]) and sums["loss"] == pytest.approx(real["loss"])
