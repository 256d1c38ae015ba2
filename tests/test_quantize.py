"""A finished run keeps its model (jaxtrain.driver.export); post-training int8 quantisation (jaxtrain.analysis.quantize,
qwix)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix

import jaxtrain as jt
from conftest import needs_fashion_mnist, run_cli
from experiments import quantize as quantize_cli
from jaxtrain import models
from jaxtrain.analysis import quantize
from jaxtrain.core import compat
from jaxtrain.data import loader, sources
from jaxtrain.errors import ConfigError
from jaxtrain.io.files import params_digest
from jaxtrain.nn import int8
from jaxtrain.driver import export


def _info(model="lenet", **extra):
    return {"model": model, "init": "d2l", "input_shape": [28, 28, 1], "num_classes": 10,
            "settings": {"dataset": "fashion_mnist"}, **extra}


def test_a_saved_model_loads_back_bit_exact(tmp_path):
    params, state = models.get("resnet18").init(jax.random.key(3))
    export.save(tmp_path, params, state, _info("resnet18", test_acc=0.5))
    meta, p, s = export.load(tmp_path, "resnet18")
    assert meta["test_acc"] == 0.5 and meta["params_digest"] == params_digest(params)
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p, s))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("damage, says", [
    ("missing", "no such directory"), ("empty", "holds no saved model"), ("other", "holds a lenet model, not vit"),
    ("json", "model.json is unreadable"), ("digest", "do not match the digest"), ("arrays", "cannot be read"),
    ("ten", r"model.json is unreadable \(TypeError: .*num_classes 'ten'"),
    ("eleven", r"do not have the shapes model.json describes \(\['params'\]\['dense2'\]\['b'\] \(10,\) vs \(11,\)"),
    ("truncated", "cannot be read"),
])
def test_a_bad_run_directory_is_one_line(tmp_path, damage, says):
    run = tmp_path / "run"
    if damage != "missing":
        run.mkdir()
    if damage not in ("missing", "empty"):
        export.save(run, *models.get("lenet").init(jax.random.key(0)), _info())
    if damage == "json":
        (run / export.INFO).write_text("{not json")
    if damage == "digest":
        meta = json.loads((run / export.INFO).read_text())
        (run / export.INFO).write_text(json.dumps({**meta, "params_digest": "0" * 64}))
    if damage in ("ten", "eleven"):  # hand-edited: a raw TypeError, or a wrong class count loaded silently
        meta = json.loads((run / export.INFO).read_text())
        (run / export.INFO).write_text(json.dumps({**meta, "num_classes": "ten" if damage == "ten" else 11}))
    if damage == "truncated":
        largest = max((f for f in (run / export.ARRAYS).rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        largest.write_bytes(largest.read_bytes()[:1000])
    if damage == "arrays":
        for f in (run / export.ARRAYS).rglob("*"):
            if f.is_file() and f.stat().st_size > 1000:
                f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.raises(ConfigError, match=says) as e:
        export.load(run, "vit" if damage == "other" else None)
    assert "\n" not in str(e.value)
    if damage == "truncated":  # and nothing more is printed: tensorstore's late callbacks once printed tracebacks
        code = f"from jaxtrain.driver import export\ntry: export.load({str(run)!r})\nexcept Exception as e: print(e)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "cannot be read" in out.stdout and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_a_late_closed_loop_report_during_the_read_prints_nothing(tmp_path):
    """tensorstore's late callbacks can report "Event loop is closed" while orbax is still unwinding the failed
    read, before its error reaches us (seen under load on Python 3.13): the report is dropped there too."""
    run = tmp_path / "run"
    run.mkdir()
    export.save(run, *models.get("lenet").init(jax.random.key(0)), _info())
    code = ("import sys, orbax.checkpoint as ocp\n"
            "class Late:\n"
            "    def __del__(self): raise RuntimeError('Event loop is closed')\n"
            "def restore(self, *a, **k):\n"
            "    Late()\n"  # collected at once: Python reports its __del__'s error as unraisable, here and now
            "    raise ValueError('truncated')\n"
            "ocp.StandardCheckpointer.restore = restore\n"
            "from jaxtrain.driver import export\n"
            f"try: export.load({str(run)!r})\nexcept Exception as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "cannot be read (truncated)" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "Event loop is closed" not in out.stderr, out.stderr[-2000:]


LATE_TASKS = """
import asyncio, gc, sys
from jaxtrain.io import files
if sys.argv[1] == "drop":
    files.drop_late_read_reports()  # as export.load and the checkpointer do before any orbax call
class Read:  # an awaitable that is no coroutine, as tensorstore's futures: asyncio wraps it in a task of its own
    def __init__(self, text):
        self.text = text
    def __await__(self):
        raise ValueError(self.text)
        yield
async def fail(text):  # a user's coroutine
    raise RuntimeError(text)
async def main():  # tasks failing where nobody awaits them: an orbax read after its first error, and a user's
    for failing in (Read("OUT_OF_RANGE: Error reading 'params.dense1.w/0.0' in OCDBT database"),
                    fail("RESOURCE_EXHAUSTED: Out of memory allocating 8796093022208 bytes"), fail("a bug of ours")):
        task = asyncio.ensure_future(failing)
        await asyncio.sleep(0)
        del task
    gc.collect()  # asyncio reports each then: "Task exception was never retrieved", with its traceback
asyncio.run(main())
"""


def test_a_late_tensorstore_task_report_after_the_read_prints_nothing_and_others_still_do():
    """Seen once under load on Python 3.13: after a truncated model's one line, asyncio logged "Task exception was
    never retrieved" with a traceback for another of orbax's reads. Such reports of tensorstore's futures are
    dropped; a coroutine's task still says its error, a status code first too (JAX's own errors have them)."""
    def run(how):
        return subprocess.run([sys.executable, "-c", LATE_TASKS, how], capture_output=True, text=True, timeout=120)

    before, after = run("bare"), run("drop")  # without, then with the drop installed
    for said in ("OUT_OF_RANGE", "RESOURCE_EXHAUSTED: Out of memory", "a bug of ours"):
        assert said in before.stderr, before.stderr[-2000:]
    assert "OUT_OF_RANGE" not in after.stderr, after.stderr[-2000:]
    assert "RESOURCE_EXHAUSTED: Out of memory" in after.stderr and "a bug of ours" in after.stderr, after.stderr[-2000:]


@pytest.fixture(scope="module")
def trained_lenet():
    """LeNet after 300 Adam steps on Fashion-MNIST (test acc ~0.8), and 512 test images."""
    train = sources.load_split("fashion_mnist", "train").head(19200)
    test = sources.load_split("fashion_mnist", "test").head(512)
    model = models.get("lenet")
    trainer = jt.make_train_step(model.loss_fn, optax.adam(2e-3), mesh=jt.make_mesh(jax.devices()[:1]))
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    batches = loader.Loader(train, 64, train=True, seed=0)
    for epoch in range(1):
        for batch in batches.epoch(epoch):
            state, _ = trainer(state, batch)
    return jax.device_get(state.params), loader.normalise(test.images), test.labels


@needs_fashion_mnist
def test_int8_lenet_agrees_with_fp32_and_runs_integer_ops(trained_lenet):
    params, images, labels = trained_lenet
    q = quantize.quantize(_info(), params, {})
    fp32, int8 = np.asarray(q.fp32(images)).argmax(-1), np.asarray(q.int8(images)).argmax(-1)
    assert (fp32 == labels).mean() > 0.7  # trained
    assert (fp32 == int8).mean() >= 0.99
    ops = quantize.integer_ops(q.compiled_text(images))
    assert ops == {"convolution": 2, "dot": 2, "s8": 4}  # on int8 operands: the int8 program's own CPU options
    assert quantize.integer_ops(q.compiled_text(images, "fp32")) == {"convolution": 0, "dot": 0, "s8": 0}
    for name, layer in q.int8_params.items():
        w = layer["w"]
        assert isinstance(w, qwix.QArray) and w.qvalue.dtype == jnp.int8 and w.scale.dtype == jnp.float32
        assert w.scale.size == params[name]["w"].shape[-1]  # a scale per output channel
        np.testing.assert_allclose(w.qvalue * w.scale, params[name]["w"], atol=float(w.scale.max()) / 2 + 1e-7)
    assert q.int8_param_bytes < 0.26 * q.fp32_param_bytes


def test_int8_resnet18_quantises_every_conv_and_the_classifier():
    params, stats = models.get("resnet18").init(jax.random.key(0))
    q = quantize.quantize(_info("resnet18"), params, stats)
    images = np.random.default_rng(0).random((4, 28, 28, 1), dtype=np.float32)
    ops = quantize.integer_ops(q.compiled_text(images))
    assert (ops["convolution"], ops["dot"]) == (20, 1)
    leaves = {jax.tree_util.keystr(k, simple=True, separator="/"): v
              for k, v in jax.tree_util.tree_flatten_with_path(q.int8_params)[0]}
    qvalues = [k for k in leaves if k.endswith("kernel/array/qvalue")]
    assert len(qvalues) == 21 and all(leaves[k].dtype == jnp.int8 for k in qvalues)
    assert all(leaves[k.replace("qvalue", "scale")].dtype == jnp.float32 for k in qvalues)
    assert not any(v.dtype == jnp.float32 and k.endswith("kernel") for k, v in leaves.items())
    assert 0.25 <= q.int8_param_bytes / q.fp32_param_bytes < 0.26
    fp32, int8 = np.asarray(q.fp32(images)), np.asarray(q.int8(images))
    np.testing.assert_allclose(int8, fp32, atol=0.05 * np.abs(fp32).max())  # same model, int8 rounding


def test_another_model_is_refused():
    with pytest.raises(ConfigError, match="covers lenet, resnet18; this run trained vit"):
        quantize.quantize(_info("vit"), {}, {})


def test_the_cli_says_a_bad_run_in_one_line(tmp_path, capsys):
    assert quantize_cli.main(["--run", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"quantize: error: --run {tmp_path / 'nope'}: no such directory")
    with pytest.raises(SystemExit) as e:  # argparse's one line (tests/test_experiment_args.py)
        quantize_cli.main(["--run", str(tmp_path), "--batch-sizes", "0"])
    assert e.value.code == 2


@needs_fashion_mnist
@pytest.mark.slow
def test_a_finished_lenet_run_is_quantised_from_its_directory(tmp_path):
    out = tmp_path / "run"
    r = run_cli("-m", "experiments.lenet", "--devices", "2", "--optimizer", "adam", "--lr", "2e-3", "--epochs", "1",
                "--train-subset", "12800", "--batch-size", "64", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "model.json").read_text())["model"] == "lenet"
    r = run_cli("-m", "experiments.quantize", "--run", str(out), "--repeats", "2", "--json", str(tmp_path / "q.json"),
                env={"XLA_FLAGS": ""})  # as users run it: only the flags jaxtrain sets itself
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "q.json").read_text())
    assert result["test_examples"] == 10000 and result["fp32_acc"] > 0.7
    assert abs(result["int8_acc"] - result["fp32_acc"]) < 0.01 and result["argmax_agreement"] >= 0.99
    assert result["int8_param_bytes"] < 0.26 * result["fp32_param_bytes"]
    assert (result["int8_convolutions"], result["int8_dots"], result["int8_operands"]) == (2, 2, 4)
    assert "| test accuracy |" in r.stdout


def test_fake_int8_is_the_int8_grid_with_a_straight_through_gradient():
    w = np.random.default_rng(0).normal(size=(5, 5, 20, 50)).astype(np.float32)
    q = int8.int8_weight(w)
    np.testing.assert_array_equal(int8.fake_int8(jnp.asarray(w), -1), q.qvalue * q.scale)
    np.testing.assert_array_equal(jax.grad(lambda w: (int8.fake_int8(w, -1) * 3).sum())(w), np.full_like(w, 3))


def test_a_quantisation_aware_lenet_computes_what_its_int8_export_computes(trained_lenet):
    """QAT's forward (float math on int8-rounded values) = the post-training int8 model's (integer math)."""
    params, images, _ = trained_lenet
    qat = models.get("lenet", quantize="int8")
    got = np.asarray(jax.jit(qat.logits)(params, {}, images))
    want = np.asarray(quantize.quantize(_info(), params, {}).int8(images))
    # Where both round every value to the same int8 code they compute the same numbers, up to float
    # re-association (float32 sums vs exact int32 ones): within 1e-5 here. But a value that sits at a rounding
    # tie of the int8 grid can land on either side, depending on how the CPU's vector width re-associated the
    # sum that made it: one of 512 examples, one code, on an AVX2-only CPU (its logit moved by 2e-3).
    same = np.isclose(got, want, rtol=1e-5, atol=1e-5).all(axis=1)
    assert same.mean() >= 0.99, f"{(~same).sum()} of {len(same)} examples differ"
    # One code of one activation is 1/127 of its example's absmax, one term of a layer's sums: it moves the
    # logits by far less than 1% of their spread (a wrong scale or a float layer would move them by ~100%).
    spread = want.max(axis=1) - want.min(axis=1)
    moved = np.abs(got - want).max(axis=1)
    assert (moved[~same] <= 0.01 * spread[~same]).all(), moved[~same] / spread[~same]


def _qat_steps(strategy, devices, steps=4):
    model = models.get("lenet", quantize="int8")
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.5), mesh=jt.make_mesh(jax.devices()[:devices]),
                                 strategy=strategy)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    batch = models.get("lenet").example_batch(32)
    losses = []
    for _ in range(steps):
        state, metrics = trainer(state, batch)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses


def test_a_quantisation_aware_step_equals_one_device_and_learns():
    ref, losses = _qat_steps("jit", 1)
    assert losses[-1] < losses[0]
    # QAT scales activations per example and weights per output channel, so no scale spans devices: each way of
    # splitting the step is run once (GSPMD; per-shard code at 2 and 4 shards; pmap). ring is shard_map's
    # per-shard code with another all-reduce, which test_step checks.
    for strategy, devices in (("jit", 2), ("shard_map", 2), ("shard_map", 4), ("pmap", 2)):
        params, _ = _qat_steps(strategy, devices)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{strategy} x {devices}")


def test_quantisation_aware_training_is_refused_where_not_built():
    """It names the post-training way where there is one (a new user was sent to experiments.quantize with a GPT,
    which it refuses)."""
    with pytest.raises(ConfigError, match=r"quantize=int8: quantisation-aware training covers int8 for lenet only "
                                          r"\(model resnet18: post-training int8 with python -m "
                                          r"experiments.quantize\)"):
        models.get("resnet18", quantize="int8")
    with pytest.raises(ConfigError, match=r"\(model gpt: nor post-training int8, which covers lenet and resnet18\)"):
        models.get("gpt", quantize="int8")


@needs_fashion_mnist
@pytest.mark.slow
def test_a_quantisation_aware_run_exports_the_int8_model_it_evaluated(tmp_path):
    out = tmp_path / "qat"
    r = run_cli("-m", "experiments.lenet", "--devices", "2", "--quantize", "int8", "--optimizer", "adam",
                "--lr", "2e-3", "--epochs", "1", "--train-subset", "6400", "--batch-size", "64", "--out", str(out),
                "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "quantisation-aware int8" in r.stdout
    trained = json.loads((out / "summary.json").read_text())["test_acc"]  # evaluated with int8-rounded numbers
    r = run_cli("-m", "experiments.quantize", "--run", str(out), "--repeats", "1", "--batch-sizes", "1",
                "--json", str(tmp_path / "q.json"), env={"XLA_FLAGS": ""})
    assert r.returncode == 0, r.stderr
    assert abs(json.loads((tmp_path / "q.json").read_text())["int8_acc"] - trained) <= 0.002
    r = run_cli("-m", "experiments.resnet18", "--quantize", "int8", "--max-steps", "1")
    assert r.returncode == 2 and "covers int8 for lenet only" in r.stderr and "Traceback" not in r.stderr


def test_quantize_reads_the_runs_own_data_and_never_downloads(tmp_path, capsys):
    """A cifar10 run without --data-dir tried to download CIFAR-10 for minutes before failing."""
    from test_datasets import make_cifar_dir

    from experiments import quantize as quantize_cli

    run = tmp_path / "run"
    run.mkdir()
    info = {**_info(), "input_shape": [32, 32, 3], "settings": {"dataset": "cifar10"}}
    export.save(run, *models.get("lenet", input_shape=(32, 32, 3)).init(jax.random.key(0)), info)
    args = ["--run", str(run), "--tfds-dir", str(tmp_path / "tfds"), "--repeats", "1", "--batch-sizes", "1"]
    assert quantize_cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dataset cifar10 not found" in err and "--data-dir" in err, err
    make_cifar_dir(tmp_path / "cifar", per_file=2, n_test=6)
    (run / "summary.json").write_text(json.dumps({"data_source": str(tmp_path / "cifar")}))  # as the run wrote it
    assert quantize_cli.main([*args, "--json", str(tmp_path / "q.json")]) == 0
    assert json.loads((tmp_path / "q.json").read_text())["test_examples"] == 6


def test_bench_int8_times_each_layer_in_fp32_and_both_int8_paths(tmp_path):
    out = run_cli("-m", "experiments.bench_int8", "--batch-size", "2", "--resnet-batch", "1", "--repeats", "1",
                  "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["cpu_isa"] == compat.cpu_isa() and "INDIVIDUAL_CONVOLUTION" in str(result["options"])
    assert set(result["ms"]) >= {"LeNet conv2", "LeNet conv2 as one GEMM (im2col)", "ResNet-18 stage 4 conv"}
    assert all(set(row) == {"fp32", "int8, training flags", "int8, YNNPACK", "quantise only"} and min(row.values()) > 0
               for row in result["ms"].values())
    assert "| LeNet conv2 |" in out.stdout and "best int8 / fp32" in out.stdout
