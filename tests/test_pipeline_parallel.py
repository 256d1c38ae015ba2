"""Pipeline parallelism (jaxtrain.train.pipeline): GPipe and circular schedules against the sequential model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import needs_fashion_mnist
from reference import float64_steps
from tolerance import assert_reassociated

import jaxtrain as jt
from jaxtrain.errors import ConfigError
from jaxtrain.models.sequential import sequential_loss
from jaxtrain.train import pipeline

LAYERS, WIDTH = 8, 16
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.3), "adam": lambda: optax.adam(1e-2)}


def embed_fn(E, batch):
    return jnp.tanh(batch["x"] @ E["w"])


def stage_fn(p, x):  # a residual MLP block with a per-example normalisation (no batch statistics)
    h = x - x.mean(-1, keepdims=True)
    return x + jnp.tanh(h @ p["w"] + p["b"])


def head_loss_fn(H, x, batch):
    logits = x @ H["w"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def init_fn(rng, layers=LAYERS):
    k = jax.random.split(rng, 4)
    return {"embed": {"w": jax.random.normal(k[0], (8, WIDTH)) / 3},
            "stages": {"w": jax.random.normal(k[1], (layers, WIDTH, WIDTH)) / 4,
                       "b": jax.random.normal(k[2], (layers, WIDTH)) / 10},
            "head": {"w": jax.random.normal(k[3], (WIDTH, 5)) / 4}}


def batches(n=3, size=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(size, 8)).astype(np.float32), "y": rng.integers(0, 5, size).astype(np.int32)}
            for _ in range(n)]


@functools.cache
def reference_of(opt):
    return reference(OPTIMIZERS[opt](), batches())


@functools.cache
def exact_of(opt):
    """The sequential model's steps in float64: what both the pipeline and the plain model are held to (the
    tolerance policy, tests/tolerance.py)."""
    return float64_steps(sequential_loss(embed_fn, stage_fn, head_loss_fn), OPTIMIZERS[opt](),
                         init_fn(jax.random.key(0)), batches())


def reference(tx, data):
    trainer = jt.make_train_step(sequential_loss(embed_fn, stage_fn, head_loss_fn), tx, mesh=1)
    state = trainer.init(init_fn(jax.random.key(0)))
    losses = []
    for b in data:
        state, m = trainer(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def pipelined(tx, data, axes, **kw):
    mesh = jt.make_mesh(int(np.prod(list(axes.values()))), axes=axes)
    trainer = jt.make_pipeline_step(embed_fn, stage_fn, head_loss_fn, tx, mesh=mesh, **kw)
    state = trainer.init(init_fn=init_fn, rng=jax.random.key(0))
    losses = []
    for b in data:
        state, m = trainer(state, b)
        losses.append(float(m["loss"]))
    return trainer, state, losses


@pytest.mark.parametrize("opt,axes,kw", [
    ("sgd", {"data": 1, "stage": 2}, dict(microbatches=1)),  # the naive model parallelism
    ("adam", {"data": 1, "stage": 2}, dict(microbatches=4)),
    ("sgd", {"data": 1, "stage": 4}, dict(microbatches=8)),
    ("adam", {"data": 1, "stage": 4}, dict(microbatches=1)),
    ("sgd", {"data": 1, "stage": 4}, dict(microbatches=4, schedule="circular", repeats=2)),
    ("adam", {"data": 1, "stage": 4}, dict(microbatches=8, schedule="circular", repeats=2)),
    ("sgd", {"data": 1, "stage": 2}, dict(microbatches=8, schedule="circular", repeats=2, remat="full")),
    ("sgd", {"data": 2, "stage": 2}, dict(microbatches=4)),
    ("adam", {"data": 2, "stage": 2}, dict(microbatches=4, schedule="circular", repeats=2)),
])
def test_pipelined_steps_equal_the_sequential_model(opt, axes, kw):
    ref, ref_losses = reference_of(opt)  # the plain model on 1 device, shared by the cases
    trainer, state, losses = pipelined(OPTIMIZERS[opt](), batches(), axes, **kw)
    exact = exact_of(opt)
    got = {**state.params, "stages": pipeline.layers(state.params["stages"])}
    assert_reassociated(got, ref.params, exact.params, "params", exact.start_params)
    exact_losses = [float(h["loss"]) for h in exact.history]
    assert_reassociated(losses, ref_losses, exact_losses, "losses", exact_losses[:1] * len(exact_losses))


def test_each_stage_holds_only_its_layers_and_the_step_gathers_none():
    trainer, state, _ = pipelined(optax.adam(1e-2), batches(1), {"data": 1, "stage": 4}, microbatches=4,
                                  schedule="circular", repeats=2)
    w = state.params["stages"]["w"]  # [R=2, S=4, K=1, ...]
    assert w.shape == (2, 4, 1, WIDTH, WIDTH) and tuple(w.sharding.spec)[:2] == (None, "stage")
    assert set(tuple(w.sharding.spec)[2:]) <= {None}
    logical = np.asarray(pipeline.layers(state.params["stages"])["w"])
    for shard in w.addressable_shards:
        stage = list(trainer.mesh.devices.flat).index(shard.device)  # data=1: device index = stage index
        assert shard.data.shape == (2, 1, 1, WIDTH, WIDTH)
        np.testing.assert_array_equal(np.asarray(shard.data)[:, 0, 0], logical[[stage, stage + 4]])  # chunks s, s+S
    mu = state.opt_state[0].mu["stages"]["w"]
    assert mu.sharding.spec == w.sharding.spec  # Adam's moments follow their layers
    stats = jt.compiled_stats(trainer, state, batches(1)[0], residuals=False)["collectives"]
    assert "all-gather" not in stats, stats
    assert stats["collective-permute"]["ops"] >= 1, stats


def test_pipelined_evaluation_equals_the_sequential_model():
    trainer, state, _ = pipelined(optax.sgd(0.3), batches(1), {"data": 2, "stage": 2}, microbatches=2)

    def head_eval_fn(H, x, batch):
        logits = x @ H["w"]
        return {"accuracy": (logits.argmax(-1) == batch["y"]).astype(jnp.float32),
                "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])}

    def plain_eval_fn(params, model_state, batch):
        x = embed_fn(params["embed"], batch)
        for i in range(LAYERS):
            x = stage_fn(jax.tree.map(lambda w: w[i], params["stages"]), x)
        return head_eval_fn(params["head"], x, batch)

    batch = batches(1, size=32)[0]
    got = jt.make_eval_step(trainer.eval_fn(head_eval_fn), mesh=trainer.mesh)(state, batch)
    plain = {**state.params, "stages": pipeline.layers(state.params["stages"])}
    want = jax.jit(plain_eval_fn)(jax.device_get(plain), {}, batch)
    assert float(got["count"]) == 32
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"].sum()), rtol=1e-5)
    assert float(got["accuracy"]) == float(want["accuracy"].sum())


def test_a_checkpoint_resumes_the_pipelined_run_exactly(tmp_path):
    from jaxtrain.train.checkpoint import Checkpointer
    from jaxtrain.train.loop import Position

    data = batches(4)
    trainer, state, _ = pipelined(optax.adam(1e-2), data[:2], {"data": 1, "stage": 2}, microbatches=2)
    ck = Checkpointer(tmp_path / "ck", keep=2)
    ck.save(state, Position(total_steps=2), wait=True)
    ck.close()
    for b in data[2:]:
        state, _ = trainer(state, b)
    again = Checkpointer(tmp_path / "ck", keep=2)
    restored = again.restore(trainer.init(init_fn=init_fn, rng=jax.random.key(1))).state
    again.close()
    for b in data[2:]:
        restored, _ = trainer(restored, b)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))


@pytest.mark.parametrize("axes,kw,layers,match", [
    ({"data": 4}, {}, LAYERS, "pipelining needs a mesh axis 'stage'"),
    ({"data": 1, "stage": 4}, dict(microbatches=2, schedule="circular", repeats=2), LAYERS,
     "circular schedule needs microbatches >= stages"),
    ({"data": 1, "stage": 4}, dict(repeats=2), LAYERS, "repeats=2 needs schedule='circular'"),
    ({"data": 1, "stage": 4}, dict(schedule="1f1b"), LAYERS, "unknown schedule '1f1b'"),
    ({"data": 1, "stage": 4}, dict(microbatches=4, schedule="circular", repeats=2), 12,
     "12 layers do not split into 4 stages x 2 repeats"),
])
def test_bad_pipelines_are_one_line_errors_before_compiling(axes, kw, layers, match):
    mesh = jt.make_mesh(4, axes=axes)
    with pytest.raises(ConfigError, match=match) as e:
        trainer = jt.make_pipeline_step(embed_fn, stage_fn, head_loss_fn, optax.sgd(0.1), mesh=mesh, **kw)
        trainer.init(init_fn=lambda r: init_fn(r, layers), rng=jax.random.key(0))
    assert "\n" not in str(e.value)


def test_a_batch_that_does_not_split_into_the_microbatches_is_a_one_line_error():
    mesh = jt.make_mesh(4, axes={"data": 2, "stage": 2})
    trainer = jt.make_pipeline_step(embed_fn, stage_fn, head_loss_fn, optax.sgd(0.1), mesh=mesh, microbatches=4)
    state = trainer.init(init_fn=init_fn, rng=jax.random.key(0))
    with pytest.raises(ConfigError, match="batch size 12 does not split evenly over 2 data shards x 4 micro-batches"):
        trainer(state, batches(1, size=12)[0])


def test_the_step_counts_its_bubble():
    for kw, stages, ticks in ((dict(microbatches=4), 2, 5),
                              (dict(microbatches=4, schedule="circular", repeats=2), 2, 9)):
        trainer, state, _ = pipelined(optax.sgd(0.1), [], {"data": 2, "stage": stages}, **kw)
        _, metrics = trainer(state, batches(1)[0])
        assert float(metrics["pipeline_bubble"]) == pytest.approx((stages - 1) / ticks) == trainer.bubble


@pytest.mark.slow
def test_bench_pipeline_prints_the_bubble_table(tmp_path):
    import json

    from conftest import run_cli

    out = run_cli("-m", "experiments.bench_pipeline", "--devices", "2", "--stages", "2", "--microbatches", "2",
                  "--steps", "1", "--repeats", "1", "--json", str(tmp_path / "rows.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["schedule"], r["microbatches"]) for r in rows] == [("gpipe", 2), ("circular", 2)]
    assert all(r["counted_bubble"] == pytest.approx(r["theory_bubble"]) for r in rows)
    assert all(r["temp_mib_full"] < r["temp_mib_none"] for r in rows), rows  # remat keeps less per stage
    assert "bubble: timed" in out.stdout


@needs_fashion_mnist
@pytest.mark.slow
def test_pipelined_vit_cli_stops_on_sigterm_and_resumes_to_the_uninterrupted_digest(tmp_path):
    import json
    import signal

    from conftest import run_cli
    from test_distributed import digest, start, wait_for

    common = ["-m", "experiments.vit", "--devices", "4", "--mesh", "data=2,stage=2", "--microbatches", "2",
              "--pipeline-schedule", "circular", "--repeats", "2", "--batch-size", "32", "--train-subset", "1024",
              "--test-subset", "128", "--max-steps", "12", "--checkpoint-every", "4", "--no-progress"]
    full = run_cli(*common, "--checkpoint-dir", str(tmp_path / "ck-full"), "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr[-3000:]
    assert "pipeline 2 stages x 2 micro-batches (circular, repeats 2, bubble 20%)" in full.stdout, full.stdout
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["pipeline"] == {"stages": 2, "microbatches": 2, "schedule": "circular", "repeats": 2,
                                   "bubble": pytest.approx(0.2), "counted_bubble": pytest.approx(0.2)}
    assert "all-gather" not in summary["collectives"] and summary["mesh"] == {"data": 2, "stage": 2}

    ck = tmp_path / "ck"
    proc = start(*common, "--checkpoint-dir", str(ck), "--out", str(tmp_path / "a"))
    wait_for(ck / "4", proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "continue with --resume" in output, output[-3000:]
    resumed = run_cli(*common, "--checkpoint-dir", str(ck), "--out", str(tmp_path / "b"), "--resume")
    assert resumed.returncode == 0 and "resuming from step" in resumed.stdout, resumed.stderr[-3000:]
    assert digest(tmp_path / "b") == digest(tmp_path / "full")
    gpipe = [*common[:9], "gpipe", "--repeats", "1", *common[12:]]  # another layout of the layers
    other = run_cli(*gpipe, "--checkpoint-dir", str(ck), "--out", str(tmp_path / "c"), "--resume")
    assert other.returncode == 2 and "pipeline_layout" in other.stderr, other.stderr[-2000:]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_policies_pipeline_as_closely_as_the_sequential_model(precision):
    """bf16 / fp16 runs differ from fp32 by rounding; pipelined, by no more than the plain model does."""
    data = batches()
    trainer = jt.make_train_step(sequential_loss(embed_fn, stage_fn, head_loss_fn), optax.sgd(0.3), mesh=1,
                                 precision=precision)
    ref = trainer.init(init_fn(jax.random.key(0)))
    mesh = jt.make_mesh(4, axes={"data": 2, "stage": 2})
    piped = jt.make_pipeline_step(embed_fn, stage_fn, head_loss_fn, optax.sgd(0.3), mesh=mesh, microbatches=2,
                                  schedule="circular", repeats=2, precision=precision)
    state = piped.init(init_fn=init_fn, rng=jax.random.key(0))
    for b in data:
        ref, ref_m = trainer(ref, b)
        state, m = piped(state, b)
        np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=2e-2)
    if precision == "fp16":  # the dynamic loss scale is the usual one, in the state
        assert float(m["loss_scale"]) == float(ref_m["loss_scale"]) and float(m["grads_finite"]) == 1.0
    fp32 = jax.device_get(reference_of("sgd")[0].params)
    got = jax.device_get({**state.params, "stages": pipeline.layers(state.params["stages"])})

    def error(params, part):
        return max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(params[part]),
                                                                jax.tree.leaves(fp32[part])))

    # Pipelined and plain sum in other orders: at most 2 roundings (ulps of the compute dtype at the params'
    # size) apart. Measured: within 1.0-1.25x of the plain model's error on jax 0.10.2, 1.54x (fp16 stages,
    # +0.00033 = 1.4 ulps) on jax 0.12.
    ulp = float(jnp.finfo(jnp.bfloat16 if precision == "bf16" else jnp.float16).eps) / 2
    for part in ("embed", "stages", "head"):
        size = max(float(np.abs(w).max()) for w in jax.tree.leaves(fp32[part]))
        assert 0 < error(got, part) <= error(jax.device_get(ref.params), part) + 2 * ulp * size, part
