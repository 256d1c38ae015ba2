"""Optimizers and schedules by name (jaxtrain.core.optim): each builds the chain it says; clipping sees the global
norm."""

import json
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_fashion_mnist, random_batch, run_cli

import jaxtrain as jt
from jaxtrain.core import optim
from jaxtrain.errors import ConfigError
from jaxtrain.models import lenet

TOL = {"rtol": 1e-5, "atol": 1e-6}


def values(schedule, steps):
    return np.array([float(schedule(s)) for s in steps])


def test_schedules_give_the_learning_rate_they_say():
    lr, total, warm = 0.4, 100, 10
    np.testing.assert_allclose(values(optim.make_schedule("constant", lr), [0, 50, 1000]), lr)

    def cosine(t):
        return lr * 0.5 * (1 + math.cos(math.pi * t / total))

    np.testing.assert_allclose(values(optim.make_schedule("cosine", lr, total), [0, 25, 50, 100]),
                               [cosine(t) for t in (0, 25, 50, 100)], atol=1e-7)
    warm_cos = optim.make_schedule("warmup_cosine", lr, total, warm)

    def after(t):  # past the warm-up
        return lr * 0.5 * (1 + math.cos(math.pi * (t - warm) / (total - warm)))

    np.testing.assert_allclose(values(warm_cos, [0, 5, 10, 55, 100]), [0, lr / 2, lr, after(55), 0], atol=1e-6)
    onecycle = values(optim.make_schedule("onecycle", lr, total, warm), range(total + 1))
    assert onecycle.argmax() == warm and onecycle.max() == pytest.approx(lr)
    assert onecycle[0] < lr / 10 and onecycle[-1] < lr / 100  # up from lr/25, down to far below it
    default = values(optim.make_schedule("onecycle", lr, total), range(total + 1))
    assert default.argmax() == 30  # no warm-up given: 30% of the run


@pytest.mark.parametrize("bad, match", [
    (dict(name="cosine"), "needs the run's length"),
    (dict(name="warmup_cosine", total_steps=10, warmup_steps=10), "does not fit a run of 10 steps"),
    (dict(name="linear", total_steps=10), "unknown learning-rate schedule 'linear'"),
])
def test_bad_schedules_are_one_line_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        optim.make_schedule(lr=0.1, **bad)


def hand_written(name, lr, wd, steps, params, grads, momentum=0.9, b1=0.9, b2=0.999, eps=1e-8):
    """The textbook update rules, applied ``steps`` times with the same gradients."""
    p = {k: np.array(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t in range(1, steps + 1):
        for k in p:
            decay = wd if p[k].ndim > 1 else 0.0
            g = np.asarray(grads[k], np.float64) + (decay * p[k] if name != "adamw" else 0)
            if name == "sgd":
                p[k] = p[k] - lr * g
            elif name in ("momentum", "nesterov"):
                m[k] = momentum * m[k] + g
                p[k] = p[k] - lr * (g + momentum * m[k] if name == "nesterov" else m[k])
            else:
                m[k] = b1 * m[k] + (1 - b1) * g
                v2[k] = b2 * v2[k] + (1 - b2) * g * g
                step = (m[k] / (1 - b1 ** t)) / (np.sqrt(v2[k] / (1 - b2 ** t)) + eps)
                p[k] = p[k] - lr * (step + (decay * p[k] if name == "adamw" else 0))
    return p


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_each_optimizer_is_the_textbook_rule_with_weight_decay_on_kernels_only(name):
    rng = np.random.default_rng(0)
    params = {"kernel": rng.normal(size=(3, 4)).astype(np.float32), "bias": rng.normal(size=(4,)).astype(np.float32)}
    grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
    tx = optim.make_optimizer(name, 0.05, weight_decay=0.1)
    state, p = tx.init(params), jax.tree.map(jnp.asarray, params)
    for _ in range(3):
        updates, state = tx.update(grads, state, p)
        p = jax.tree.map(lambda a, u: a + u, p, updates)
    expected = hand_written(name, 0.05, 0.1, 3, params, grads)
    chex.assert_trees_all_close(jax.device_get(p), {k: v.astype(np.float32) for k, v in expected.items()}, **TOL)
    no_decay = hand_written(name, 0.05, 0.0, 3, params, grads)
    assert not np.allclose(expected["kernel"], no_decay["kernel"])  # decay applied to the kernel...
    np.testing.assert_allclose(expected["bias"], no_decay["bias"])  # ...and not to the bias


def test_clipping_rescales_to_the_global_norm():
    grads = {"a": jnp.full((4,), 3.0), "b": jnp.full((2, 2), 4.0)}  # global norm sqrt(4*9 + 4*16) = 10
    tx = optim.make_optimizer("sgd", 1.0, clip_grad_norm=2.5)
    updates, _ = tx.update(grads, tx.init(grads), grads)
    chex.assert_trees_all_close(updates, jax.tree.map(lambda g: -g / 4, grads), **TOL)  # 10 -> 2.5


BATCHES = [random_batch(64, seed=s) for s in range(3)]


def train(mesh, **kw):
    tx = optim.make_optimizer("momentum", 0.3, schedule="warmup_cosine", total_steps=6, warmup_steps=2,
                              clip_grad_norm=0.05, weight_decay=1e-3)
    trainer = jt.make_train_step(lenet.loss_fn, tx, mesh=mesh, **kw)
    state = trainer.init(lenet.init_params(jax.random.key(0), scale=0.1))
    history = []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


@pytest.fixture(scope="module")
def reference():
    return train(1)


def test_the_step_reports_the_learning_rate_each_update_used(reference):
    _, history = reference
    expected = values(optim.make_schedule("warmup_cosine", 0.3, 6, 2), range(3))  # 0, 0.15, 0.3
    np.testing.assert_allclose([h["lr"] for h in history], expected, atol=1e-7)


def test_the_clip_is_active_in_the_reference():
    """Without this the sharded runs below could not tell a global-norm clip from a per-shard one."""
    tx = optim.make_optimizer("sgd", 1.0)
    state = jt.make_train_step(lenet.loss_fn, tx, mesh=1).init(lenet.init_params(jax.random.key(0), scale=0.1))
    grads = jax.grad(lambda p: lenet.loss_fn(p, {}, BATCHES[0], None)[0])(jax.device_get(state.params))
    assert float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))) > 0.05 * 4


@pytest.mark.parametrize("strategy, kw", [
    ("jit", dict(param_sharding="fsdp")), ("shard_map", dict(param_sharding="fsdp")),
    ("ring", dict(param_sharding="fsdp")), ("shard_map", {}), ("pmap", {}),
    ("shard_map", dict(param_sharding="fsdp", accum_steps=2)),
])
def test_clipping_sees_the_global_norm_under_every_strategy_and_sharding(reference, strategy, kw):
    state, history = train(4, strategy=strategy, **kw)
    ref_state, ref_history = reference
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref_state.params), **TOL)
    chex.assert_trees_all_close(history, ref_history, **TOL)


@pytest.mark.slow  # a subprocess end to end
@needs_fashion_mnist
def test_optimizer_flags_train_and_log_the_learning_rate_per_step(tmp_path):
    out = run_cli("-m", "experiments.lenet", "--devices", "2", "--train-subset", "640", "--batch-size", "64",
                  "--epochs", "2", "--max-steps", "8", "--optimizer", "nesterov", "--lr", "0.1", "--schedule",
                  "warmup_cosine", "--warmup-epochs", "0.5", "--weight-decay", "5e-4", "--clip-grad-norm", "1",
                  "--log-every", "1", "--test-subset", "256", "--out", str(tmp_path), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    logged = {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+): loss [\d.]+, lr ([\d.e-]+),", out.stdout,
                                                            re.M)}
    assert len(logged) >= 6, out.stdout
    # 10 updates an epoch; "step N" is the N-th step (counted from 1), the schedule's update N - 1
    expected = values(optim.make_schedule("warmup_cosine", 0.1, 20, 5), [k - 1 for k in sorted(logged)])
    np.testing.assert_allclose([logged[k] for k in sorted(logged)], expected, rtol=1e-3, atol=1e-7)
    config = json.loads((tmp_path / "summary.json").read_text())
    assert config["steps"] == 8


@pytest.mark.parametrize("flags, fragment", [(["--schedule", "linear"], "--schedule"),
                                             (["--optimizer", "lion"], "--optimizer"),
                                             (["--weight-decay", "-1"], "--weight-decay"),
                                             (["--clip-grad-norm", "0"], "--clip-grad-norm")])
def test_bad_optimizer_flags_exit_2(flags, fragment):
    out = run_cli("-m", "experiments.lenet", *flags)
    assert out.returncode == 2 and fragment in out.stderr and "Traceback" not in out.stderr
