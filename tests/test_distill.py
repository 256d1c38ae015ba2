"""Distillation (jaxtrain.driver.distill): the loss, the teacher as Frozen step input under every strategy, the CLI."""

import json
import re

import jax
import numpy as np
import optax
import pytest

import jaxtrain as jt
from conftest import needs_fashion_mnist, random_batch, run_cli
from experiments import distill as distill_cli
from jaxtrain import models
from jaxtrain.core.state import Frozen
from jaxtrain.errors import ConfigError
from jaxtrain.driver import distill, export


def test_the_soft_loss_gradient_is_the_softened_cross_entropys_times_t_squared():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(8, 10)).astype(np.float32), 3 * rng.normal(size=(8, 10)).astype(np.float32)
    for temperature in (1.0, 4.0):
        targets = jax.nn.softmax(t / temperature)

        def ce(s):
            return optax.softmax_cross_entropy(s / temperature, targets).mean()

        g = jax.grad(distill.soft_loss)(s, t, temperature)
        np.testing.assert_allclose(g, temperature**2 * jax.grad(ce)(s), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(distill.soft_loss(t, t, temperature), 0, atol=1e-6)
    assert float(jax.grad(distill.soft_loss, argnums=1)(s, t, 4.0).__abs__().max()) == 0  # no gradient to it


def _teacher():
    """A LeNet teacher with its own (random) weights: cheap, and a real forward pass."""
    from jaxtrain.models import lenet

    return jax.device_get(lenet.init_params(jax.random.key(7), scale=0.1)), {}  # logits of order 1


def _distilled():
    return distill.distilled(models.get("lenet"), models.get("lenet"), *_teacher(), temperature=4.0, alpha=0.7)


def _train(model, strategy, devices, steps=3, **kw):
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.5), mesh=jt.make_mesh(jax.devices()[:devices]),
                                 strategy=strategy, **kw)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    for i in range(steps):
        state, metrics = trainer(state, random_batch(16, seed=i))
    return trainer, jax.device_get(state), jax.device_get(metrics)


@pytest.fixture(scope="module")
def one_device():
    return _train(_distilled(), "jit", 1)[1:]


@pytest.mark.parametrize("strategy, devices", [("jit", 2), ("jit", 4), ("shard_map", 2), ("ring", 2), ("pmap", 2),
                                               ("shard_map", 4)])
def test_a_distilled_step_equals_one_device_and_leaves_the_teacher_bit_identical(one_device, strategy, devices):
    state, metrics = _train(_distilled(), strategy, devices)[1:]
    ref_state, ref_metrics = one_device
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for k in ("loss", "hard_loss", "soft_loss"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5)
    assert ref_metrics["soft_loss"] > 0.01  # the teacher's outputs differ from the student's: the term is live
    teacher = state.model_state["teacher"]
    assert isinstance(teacher, Frozen)
    params, model_state = _teacher()
    for a, b in zip(jax.tree.leaves(teacher.tree), jax.tree.leaves({"params": params, "model_state": model_state})):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("strategy, devices, accum_steps", [("jit", 2, 1), ("jit", 4, 2), ("shard_map", 2, 1),
                                                            ("ring", 4, 1)])
def test_an_fsdp_student_gets_an_fsdp_teacher(one_device, strategy, devices, accum_steps):
    """The teacher is placed by the student's sharding rules: under FSDP its large weights are split over the
    devices too (gathered for its forward like the student's), and the step still equals 1 device."""
    model = _distilled()
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.5), mesh=jt.make_mesh(jax.devices()[:devices]),
                                 strategy=strategy, param_sharding="fsdp", accum_steps=accum_steps)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    teacher = state.model_state["teacher"].tree["params"]
    assert "data" in teacher["dense1"]["w"].sharding.spec and "data" in state.params["dense1"]["w"].sharding.spec
    assert "data" not in teacher["dense1"]["b"].sharding.spec  # small: replicated, like the student's
    for i in range(3):
        state, metrics = trainer(state, random_batch(16, seed=i))
    ref_state, ref_metrics = one_device
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["soft_loss"], ref_metrics["soft_loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.model_state["teacher"].tree), jax.tree.leaves(_teacher()[0])):
        np.testing.assert_array_equal(a, b)
    assert "data" in state.model_state["teacher"].tree["params"]["dense1"]["w"].sharding.spec  # still split
    evaluator = jt.make_eval_step(model.eval_fn, mesh=trainer.mesh, strategy=strategy)
    sums = jax.device_get(evaluator(state, random_batch(16, seed=9)))
    ref = jax.device_get(jt.make_eval_step(model.eval_fn, mesh=1)(jax.device_get(state), random_batch(16, seed=9)))
    np.testing.assert_allclose(sums["loss"], ref["loss"], rtol=1e-5)


def test_the_teacher_stays_out_of_the_all_reduce():
    """shard_map averages the model state over the devices; the Frozen teacher (1.7 MB here) is not in it."""
    batch = random_batch(16)
    sizes = {}
    for name, model in (("student", models.get("lenet")), ("distilled", _distilled())):
        trainer, state, _ = _train(model, "shard_map", 2, steps=1)
        state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
        sizes[name] = jt.compiled_stats(trainer, state, batch)["collectives"]["all-reduce"]["bytes"]
    assert sizes["distilled"] - sizes["student"] <= 64  # two more scalar metrics, not the teacher's weights


def test_the_soft_loss_falls_as_the_student_learns_the_teacher():
    first = _train(_distilled(), "jit", 1, steps=1)[2]["soft_loss"]
    assert _train(_distilled(), "jit", 1, steps=30)[2]["soft_loss"] < 0.5 * first


def _saved(path, model="lenet", shape=(28, 28, 1)):
    m = models.get(model, input_shape=shape)
    export.save(path, *m.init(jax.random.key(0)), {"model": model, "init": "d2l", "input_shape": list(shape),
                                                    "num_classes": 10, "settings": {"dataset": "x"}})
    return path


@pytest.mark.parametrize("case, says", [("missing", "teacher=.*: no such directory"),
                                        ("empty", "teacher=.*: holds no saved model"),
                                        ("shape", r"trained on 32x32x3 images and the student's data has "
                                                  r"28x28x1: use the teacher's dataset$"),
                                        ("classes", r"trained on 10 classes and the student's data has 5: use the "
                                                    r"teacher's dataset$")])
def test_a_bad_teacher_is_one_line(tmp_path, case, says):
    """A mismatch names what differs, and only that (a folder's classes are the teacher's until it is read)."""
    run = tmp_path / "teacher"
    if case == "empty":
        run.mkdir()
    if case in ("shape", "classes"):
        _saved(run, shape=(32, 32, 3) if case == "shape" else (28, 28, 1))
    student = models.get("lenet", num_classes=5 if case == "classes" else 10)
    with pytest.raises(ConfigError, match=says) as e:
        distill.distilled(student, *distill.teacher_from_run(str(run)), 4.0, 0.9)
    assert "\n" not in str(e.value)


def test_the_cli_needs_a_teacher_and_a_student(capsys):
    assert distill_cli.run(["--student", "lenet"]) == 2
    assert "--teacher RUN_DIR is required" in capsys.readouterr().err
    assert distill_cli.run(["--teacher", "/nowhere"]) == 2
    assert "--student NAME is required" in capsys.readouterr().err
    assert distill_cli.run(["--teacher", "/nowhere", "--student", "lenet", "--alpha", "1.5"]) == 2
    assert "--alpha 1.5: expected a weight in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --help names the student's flag as the command takes it, never --model
        distill_cli.run(["--help"])
    shown = capsys.readouterr().out
    assert "--student {lenet," in shown and not re.search(r"--model(?![-\w])", shown) and "--teacher" in shown


@needs_fashion_mnist
@pytest.mark.slow
def test_a_student_distils_from_a_finished_run_and_resumes_exactly(tmp_path):
    teacher, common = tmp_path / "teacher", ["--train-subset", "2048", "--batch-size", "64", "--no-progress"]
    r = run_cli("-m", "experiments.lenet", "--devices", "1", "--optimizer", "adam", "--lr", "2e-3", "--epochs", "1",
                "--out", str(teacher), *common)
    assert r.returncode == 0, r.stderr
    args = ["-m", "experiments.distill", "--teacher", str(teacher), "--student", "lenet", "--devices", "2",
            "--strategy", "shard_map", "--epochs", "2", *common]
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    r = run_cli(*args, *ck, "--max-steps", "40", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*args, *ck, "--resume", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    whole = run_cli(*args, "--out", str(tmp_path / "b"))
    assert whole.returncode == 0, whole.stderr
    resumed, straight = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("a", "b"))
    assert resumed["params_digest"] == straight["params_digest"]
    meta, params, state = export.load(tmp_path / "b", "lenet")
    assert state == {} and meta["settings"]["teacher"] == str(teacher)  # the student's model alone
    r = run_cli(*args, *ck, "--resume", "--alpha", "0.7", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "alpha" in r.stderr


@needs_fashion_mnist
@pytest.mark.slow  # two 3-epoch LeNet runs on 12,800 examples (~40 s each on a 2-core CPU)
def test_the_default_distillation_trains_as_well_as_the_recipe_alone(tmp_path):
    """(BAD 9) T 4, alpha 0.9 left the student at chance for 3 full epochs. The teacher is the plain recipe's own
    3-epoch run (batch 64, 600 steps: past the d2l init's plateau); the student distilled from it with every
    distillation setting at its default must reach the teacher's accuracy - 0.02. Measured: plain 0.601, distilled
    0.688; the old defaults reached 0.576 here and fail. The full-data runs are in docs/smaller-models.md,
    "Distillation"."""
    common = ["--devices", "2", "--epochs", "3", "--batch-size", "64", "--train-subset", "12800", "--no-progress"]
    plain = run_cli("-m", "experiments.lenet", *common, "--out", str(tmp_path / "teacher"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    student = run_cli("-m", "experiments.distill", "--teacher", str(tmp_path / "teacher"), "--student", "lenet",
                      *common, "--out", str(tmp_path / "student"))
    assert student.returncode == 0, student.stderr[-3000:]
    assert "T 2, alpha 0.5" in student.stdout and "at chance" not in student.stdout, student.stdout
    accuracy = {d: json.loads((tmp_path / d / "summary.json").read_text())["test_acc"] for d in ("teacher", "student")}
    assert accuracy["teacher"] > 0.4, accuracy  # the recipe did learn: the comparison means something
    assert accuracy["student"] >= accuracy["teacher"] - 0.02, accuracy


def test_a_run_at_chance_whose_loss_did_not_fall_says_so():
    from types import SimpleNamespace as Epoch

    from jaxtrain.driver.report import not_learning

    stuck = [Epoch(test_acc=0.10, train_loss=7.61)]
    assert "at chance (0.10) and the loss did not fall" in not_learning(stuck, 7.13, 10)
    assert not_learning([Epoch(test_acc=0.10, train_loss=1.0)], 2.3, 10) == ""  # the loss fell: learning, slowly
    assert not_learning([Epoch(test_acc=0.75, train_loss=2.3)], 2.3, 10) == ""
