"""RunConfig <-> command line, the model registry, one-step-late reading, the clock, the loop's hooks."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtrain as jt
from jaxtrain import choices, cli, models
from jaxtrain.core import accumulate, precision
from jaxtrain.data import loader, sources
from jaxtrain.parallel import rules, strategies
from jaxtrain.driver.config import RunConfig
from jaxtrain.train.loop import Hook, Interrupted, checkpoint_hooks, fit
from jaxtrain.train.timing import Chrono, OneStepLate, time_steps

from conftest import needs_fashion_mnist


def test_the_choices_are_the_librarys_own():
    assert choices.STRATEGIES == strategies.STRATEGIES == jt.STRATEGIES
    assert choices.PRECISIONS == tuple(precision.POLICIES)
    assert choices.ACCUM_MODES == accumulate.MODES
    assert choices.PARAM_SHARDINGS == rules.PRESETS


@pytest.mark.parametrize("config", [
    RunConfig(),
    RunConfig(model="resnet18", init="he", devices=4, mesh={"data": 2, "model": 2}, param_sharding="fsdp+tp",
              strategy="jit", precision="bf16", accum_steps=2, accum="multisteps", remat="dots", epochs=3,
              batch_size=128, lr=0.05, seed=7, out="/tmp/x", max_steps=9, summary=True, resume=True,
              checkpoint_dir="/tmp/ck", checkpoint_every=5, no_progress=True, train_subset=100, prefetch=0),
])
def test_run_config_round_trips_through_the_command_line(config):
    argv = cli.to_argv(config)
    assert cli.parse(argv, model=config.model) == config
    assert cli.parse(cli.to_argv(config, model_fixed=False)) == config


def test_the_models_recipe_fills_what_was_not_given():
    assert (RunConfig().epochs, RunConfig().batch_size, RunConfig().lr, RunConfig().init) == (10, 256, 0.2, "d2l")
    assert RunConfig(model="resnet18").lr == 0.1 and RunConfig(model="resnet18", lr=0.3).lr == 0.3


@pytest.mark.parametrize("changes, says", [
    ({"batch_size": 0}, "batch_size=0: expected a number >= 1"),
    ({"lr": -1.0}, "lr=-1.0: expected a number > 0"),
    ({"strategy": "magic"}, "strategy='magic': not one of jit, explicit, shard_map"),
    ({"init": "he"}, "init=he: model lenet has no such init"),
    ({"model": "vgg"}, "model='vgg': not one of lenet, resnet18"),
    # a new user's findings: each was accepted, then a traceback deep in the run (or a silent wrong value)
    ({"epochs": 1.5}, "epochs=1.5: expected a whole number"),
    ({"batch_size": "256"}, "batch_size='256': expected a whole number"),
    ({"lr": "0.1"}, "lr='0.1': expected a number"),
    ({"mesh": "data=2"}, "mesh='data=2': expected a dict of mesh axes, e.g. {'data': 2}"),
    ({"out": 123}, "out=123: expected text"),
    ({"devices": True}, "devices=True: expected a whole number"),
    ({"resume": 1}, "resume=1: expected True or False"),
    ({"seed": -1}, "seed=-1: expected a number >= 0"),
    ({"seed": 2**64}, "seed=18446744073709551616: expected a number <= 9223372036854775807"),
    ({"out": ""}, "out='': empty; give a value, or leave it out for its default"),
    ({"tfds_dir": " "}, "tfds_dir=' ': empty; give a value"),
    ({"classes": ""}, "classes='': empty; name at least two classes"),
    ({"pipeline_schedule": "circular"}, "pipeline_schedule=circular: for a pipelined step; give mesh= a 'stage'"),
    ({"repeats": 2}, "repeats=2: for a pipelined step"),
    ({"temperature": 3.0, "alpha": 0.3}, "temperature=3.0 and alpha=0.3: distillation's, with teacher=RUN_DIR"),
    ({"track_group": "g"}, "track_group=g: a tracker's group; give track=wandb or mlflow"),
])
def test_a_bad_value_is_a_config_error_naming_the_field(changes, says):
    with pytest.raises(jt.ConfigError, match=re.escape(says)):
        RunConfig(**changes)


def test_numbers_and_paths_of_other_types_that_mean_the_same_are_taken_as_the_settings_type(tmp_path):
    import numpy as np

    c = RunConfig(lr=np.float32(0.5), epochs=np.int64(2), out=tmp_path / "a", steps_per_call=8)
    assert (c.lr, c.epochs, c.out, c.steps_per_call) == (0.5, 2, str(tmp_path / "a"), "8")
    assert (type(c.lr), type(c.epochs)) == (float, int)  # Python's: the run writes them to JSON
    with pytest.raises(jt.ConfigError, match=r"^steps_per_call=0: expected a whole number >= 1, or auto$"):
        RunConfig(steps_per_call=0)  # said as given (it was '0', the text it became)
    c = RunConfig(summary=np.True_, devices=2, mesh={"data": np.int64(2)}, weight_decay=np.float64(0.1))
    assert (c.summary, c.mesh, c.weight_decay) == (True, {"data": 2}, 0.1)
    assert (type(c.summary), type(c.mesh["data"]), type(c.weight_decay)) == (bool, int, float)
    with pytest.raises(jt.ConfigError, match=r"^epochs=True: expected a whole number"):  # a switch is no count
        RunConfig(epochs=np.True_)
    assert RunConfig(lr=1).lr == 1
    with pytest.raises(jt.ConfigError, match="lr=inf: expected a finite number"):
        RunConfig(lr=np.float32("inf"))


def test_a_bad_flag_value_is_one_line_on_stderr_with_exit_2(capsys):
    assert cli.main("lenet", ["--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m experiments.lenet: error: --batch-size 0: expected a number >= 1"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * n.startswith(("resnet18", "vit_")))
                                  for n in models.names()])
def test_registry_models_train_on_their_example_batch(name):
    shape = (32, 32, 3) if name.startswith("vit_") else (28, 28, 1)  # 16x16 patches: sides divisible by 16
    model = models.get(name, input_shape=shape)
    batch = model.example_batch(8)
    assert batch["image"].shape == (8, *shape) and batch["label"].dtype == np.int32
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=2)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    state, metrics = trainer(state, trainer.shard(batch))
    assert np.isfinite(float(metrics["loss"]))
    with pytest.raises(jt.ConfigError, match="unknown model 'vgg'"):
        models.get("vgg")


def test_what_a_model_can_do_is_a_protocol_and_its_axes_are_logical():
    """Capabilities are protocols (not None fields); tensor-parallel rules come from logical axis names."""
    from jax.sharding import PartitionSpec as P

    from jaxtrain.driver import distill

    lenet, vit, resnet = (models.get(n) for n in ("lenet", "vit", "resnet18"))
    assert all(isinstance(m, models.Distillable) for m in (lenet, vit, resnet))
    assert isinstance(vit, models.Pipelinable) and not isinstance(lenet, models.Pipelinable)
    assert not isinstance(resnet, models.Pipelinable)
    student = distill.distilled(lenet, lenet, {}, {}, 2.0, 0.5)  # a distilled model is neither
    assert not isinstance(student, (models.Distillable, models.Pipelinable))
    assert rules.preset("tp", lenet.logical_axes) == [
        (r"dense1/w$", P(None, "model")), (r"dense1/b$", P("model")), (r"dense2/w$", P("model", None))]
    assert rules.preset("tp", resnet.logical_axes)[0][1] == P(None, None, None, "model")
    assert rules.logical_spec(("data", None, "embed")) == P("data", None, None)  # mesh names pass through
    with pytest.raises(jt.ConfigError, match="no tensor-parallel rules"):
        rules.preset("tp", vit.logical_axes)


def test_one_step_late_hands_back_the_previous_outputs_read():
    late = OneStepLate()
    assert late.push(jnp.ones(2), "a") is None and late.pending
    previous = late.push(jnp.zeros(2), "b")
    assert isinstance(previous[0], np.ndarray) and previous[0].tolist() == [1, 1] and previous[1] == "a"
    assert late.flush()[1] == "b" and late.flush() is None and not late.pending


def test_chrono_counts_waits_and_leaves_pauses_out_of_train_time(monkeypatch):
    """On a clock the test moves (a busy machine cannot stretch it): exact sums."""
    from jaxtrain.train import timing

    now, starts = [100.0], [4]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    chrono = Chrono({"train_sec": 1.0, "wait": 0.5, "start_up": 0.1, "pauses": {"checkpoint": 2.0}},
                    lambda: starts[0])
    with chrono.waiting():  # a resumed epoch's first batch: its loader starting again
        starts[0] += 1
        now[0] += 0.3
    with chrono.waiting():
        now[0] += 0.05
    with chrono.paused("checkpoint"):
        now[0] += 0.2
    now[0] += 0.25  # training
    assert chrono.train_sec == pytest.approx(1.0 + 0.3 + 0.05 + 0.25)
    assert chrono.wait == pytest.approx(0.55) and chrono.pauses["checkpoint"] == pytest.approx(2.2)
    assert chrono.start_up == pytest.approx(0.4) and chrono.wait_fraction == pytest.approx(0.55 / (1.6 - 0.4))
    assert set(chrono.state()) == {"train_sec", "wait", "start_up", "pauses"}


def test_the_loaders_start_up_is_not_a_bottleneck_and_a_stream_carried_into_the_next_epoch_has_none(monkeypatch):
    """Issue 64: every short folder run said "the input pipeline is the bottleneck": the worker processes' start-up
    (seconds, before the first batch) counted as waiting for data. Yet the workers carry on into the next epoch:
    there an epoch's first wait is a real wait, and a start-up only where they start again. On a clock the test
    moves, with the loader's count of starts in the test's hands."""
    from jaxtrain.driver.report import wait_words
    from jaxtrain.train import loop, timing

    now, starts = [0.0], [0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    epoch = loop.Loop(None, 3, None, 10, loop.Position(), lambda *_: None, lambda: starts[0])

    def run(number: int, first_wait: float, start: bool):
        epoch.start_epoch(number, 0, None)
        with epoch.chrono.waiting():
            starts[0] += start  # the workers start (or carry on: no start)
            now[0] += first_wait
        for _ in range(10):
            with epoch.chrono.waiting():
                now[0] += 0.002
            now[0] += 0.098  # the step
        loop._end_epoch(epoch)
        return epoch.stats

    first = run(1, 3.0, start=True)
    assert first.data_wait_sec == pytest.approx(0.02) and first.start_up_sec == pytest.approx(3.0)
    assert first.train_sec == pytest.approx(4.0) and first.data_wait_fraction == pytest.approx(0.02)
    assert wait_words(first.data_wait_fraction, 2) == "data wait 2.0%"  # not "the input pipeline is ..."
    carried = run(2, 0.5, start=False)  # epoch 2: the same workers, slow for its first batch
    assert carried.start_up_sec == 0 and carried.data_wait_sec == pytest.approx(0.52)
    assert carried.data_wait_fraction == pytest.approx(0.52 / 1.5)
    again = run(3, 2.0, start=True)  # epoch 3: started again (a break in the stream)
    assert again.start_up_sec == pytest.approx(2.0) and again.data_wait_sec == pytest.approx(0.02)


def _setup(n_train=1024, batch=128):
    from jaxtrain.models import lenet

    rng = np.random.default_rng(0)
    split = sources.Split(rng.integers(0, 256, (n_train, 28, 28, 1), dtype=np.uint8),
                          rng.integers(0, 10, n_train).astype(np.int32))
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    return (trainer, state, loader.Loader(split, batch, train=True), jt.make_eval_step(lenet.eval_fn, mesh=2),
            loader.Loader(split.head(256), 128, train=False))


def test_hooks_run_at_their_period_and_checkpoints_hold_the_steps_they_say():
    trainer, state, train, evaluator, test = _setup()  # 8 steps per epoch
    seen, saved = [], []
    hooks = [Hook(lambda loop: seen.append(("step", loop.total_steps)), every=3),
             Hook(lambda loop: seen.append(("epoch", loop.stats.epoch)), unit="epoch", every=2),
             *checkpoint_hooks(lambda s, p: saved.append((int(s.step), p.total_steps, p.epoch, p.batch,
                                                          p.partial.get("steps"))), every=4)]
    state, history, _ = fit(trainer, state, train, evaluator, test, epochs=2, max_steps=14, hooks=hooks,
                            progress=False)
    assert seen == [("step", 3), ("step", 6), ("step", 9), ("step", 12), ("epoch", 2)]
    # step 4 inside epoch 1; step 8 ends epoch 1 (saved after its evaluation, for epoch 2); 12; max_steps 14.
    assert saved == [(4, 4, 1, 4, 4), (8, 8, 2, 0, None), (12, 12, 2, 4, 4), (14, 14, 2, 6, 6)]
    assert [h.steps for h in history] == [8, 6]


def test_evaluation_is_a_hook_with_a_period_in_epochs_or_steps():
    trainer, state, train, evaluator, test = _setup(n_train=512)  # 4 steps per epoch
    from jaxtrain.train.loop import evaluate, evaluation

    results, states = [], {}
    keep = Hook(lambda loop: states.__setitem__(loop.total_steps, (loop.state, jax.tree.map(jnp.copy, loop.state))),
                every=3)
    at_steps = evaluation(evaluator, test, every=3, unit="step", on_result=lambda loop, r: results.append(r))
    _, history, _ = fit(trainer, state, train, evaluator, test, epochs=3, eval_every=2, hooks=[keep, at_steps],
                        progress=False)
    assert [h.test_examples for h in history] == [0, 256, 256]  # epochs 2 and 3 (the last is always evaluated)
    assert np.isnan(history[0].test_acc) and history[0].eval_sec == 0 and history[1].eval_sec > 0
    assert [r["step"] for r in results] == [3, 6, 9, 12] and all(r["count"] == 256 for r in results)
    with pytest.raises(ValueError, match="donated to a later train step"):
        evaluate(evaluator, states[6][0], test.epoch(0))  # a clear error, not jaxlib's segfault
    again = evaluate(evaluator, states[6][1], test.epoch(0))
    assert results[1]["accuracy"] == again["accuracy"] and results[1]["loss"] == pytest.approx(again["loss"])
    assert history[-1].test_acc == results[-1]["accuracy"]  # step 12 ends epoch 3


def test_a_step_evaluation_pauses_the_clock_for_itself_alone(monkeypatch):
    # a new user's finding: the pause began before the step just dispatched had run, so its compute was counted
    # as evaluation and --eval-every-steps inflated examples/s (summary.json, the step lines) up to 2x
    from jaxtrain.train import timing
    from jaxtrain.train.loop import evaluation

    trainer, state, train, evaluator, test = _setup(n_train=512)  # 4 steps per epoch
    paused, inner = [], timing.Chrono.paused

    def watched(self, what):
        if what == "eval":  # the newest call read (its step done: nothing pending) by the time the clock stops
            paused.append((loop_of[0].total_steps, loop_of[0]._late.pending))
        return inner(self, what)

    loop_of = []
    monkeypatch.setattr(timing.Chrono, "paused", watched)
    hooks = [Hook(lambda loop: loop_of[:1] or loop_of.append(loop), every=1),
             evaluation(evaluator, test, every=3, unit="step")]
    fit(trainer, state, train, evaluator, test, epochs=2, hooks=hooks, progress=False)
    assert paused == [(3, False), (6, False)], paused


def test_a_stop_request_saves_once_and_raises_interrupted_with_the_position():
    trainer, state, train, evaluator, test = _setup()
    saved = []
    hooks = checkpoint_hooks(lambda s, p: saved.append(p.total_steps), every=4, should_stop=lambda: len(saved) > 0)
    with pytest.raises(Interrupted) as e:
        fit(trainer, state, train, evaluator, test, epochs=2, hooks=hooks, progress=False)
    assert saved == [4] and e.value.position.total_steps == 4 and e.value.position.partial["steps"] == 4


def test_time_steps_times_a_step_read_one_step_late():
    trainer, state, train, _, _ = _setup()
    batch = trainer.shard(next(iter(train.epoch(0))))
    state, sec = time_steps(trainer, state, batch, 3)
    assert int(state.step) == 3 and sec > 0


def test_the_stop_vote_answers_one_call_late_with_the_largest_request():
    from jaxtrain.driver.signals import StopOnSignal, StopVote

    vote = StopVote(jax.devices())
    assert [vote(s) for s in (0, 0, 15, 0, 2, 0)] == [0, 0, 0, 15, 0, 2]
    stop = StopOnSignal(vote=StopVote(jax.devices()))
    stop.signum = 15  # as the signal thread sets it
    assert [stop.requested(), stop.requested()] == [False, True]  # the vote's answer comes one step late


@needs_fashion_mnist
def test_a_run_is_a_value_built_once(monkeypatch, tmp_path):
    """build(config) makes a local dataset's model once, before the data is read; the steps' settings are checked
    before it too (a declaration on the known shape, nothing compiled), the Run's steps made after it (the
    schedule spans its updates). The processes agree on the whole dataset's digest before it is cut to the run's
    classes and subsets (a cut that fails on one node's copy alone would leave the others waiting). A frozen Run;
    its recorded settings are what its checkpoints hold."""
    import dataclasses

    from jaxtrain.data import datasets
    from jaxtrain.driver import assemble, build as build_lib

    made, read, order = [], [], []
    for name in ("model", "steps"):
        real = getattr(assemble, name)
        monkeypatch.setattr(assemble, name, lambda *a, real=real, name=name, **k: made.append(name) or real(*a, **k))
    real_read, real_cut, real_agree = datasets.read, datasets.cut, build_lib.hosts.agree
    monkeypatch.setattr(datasets, "read", lambda c, **kw: read.append(list(made)) or order.append("read")
                        or real_read(c, **kw))
    monkeypatch.setattr(datasets, "cut", lambda *a: order.append("cut") or real_cut(*a))
    monkeypatch.setattr(build_lib.hosts, "agree", lambda *a: order.append("agree") or real_agree(*a))
    run = build_lib.build(RunConfig(devices=2, epochs=2, batch_size=64, train_subset=256, test_subset=64,
                                    schedule="cosine", checkpoint_dir=str(tmp_path / "ck"), no_progress=True))
    assert made == ["model", "steps", "steps"] and read == [["model", "steps"]]
    assert order == ["read", "agree", "cut"]
    assert (len(run.devices), run.call_batch, len(run.data["train"])) == (2, 64, 256)
    assert run.model.input_shape == (28, 28, 1)
    assert run.checkpointer.settings == run.settings and run.settings["data_sha256"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model = None
    run.checkpointer.close()
    run.loaders["train"].close(), run.loaders["test"].close()


@needs_fashion_mnist
def test_a_build_that_fails_after_opening_the_checkpoints_releases_them(monkeypatch, tmp_path):
    """Through the Python API a failed build is retried in the same process: its checkpoint directory is free."""
    from jaxtrain.data import datasets
    from jaxtrain.driver import build as build_lib

    config = RunConfig(devices=2, train_subset=256, test_subset=64, checkpoint_dir=str(tmp_path / "ck"))
    gone = jt.ConfigError("the data is gone")
    monkeypatch.setattr(datasets, "read", lambda c, **kw: (_ for _ in ()).throw(gone))
    with pytest.raises(jt.ConfigError, match="the data is gone"):
        build_lib.build(config)
    monkeypatch.undo()
    run = build_lib.build(config)  # was: "... is in use by another run (pid <this one>)"
    run.checkpointer.close()
    run.loaders["train"].close(), run.loaders["test"].close()


@needs_fashion_mnist
def test_a_subset_over_the_data_is_said_not_clamped_silently(caplog):
    from jaxtrain.driver import build as build_lib

    caplog.set_level(logging.INFO, logger="jaxtrain")
    run = build_lib.build(RunConfig(devices=1, train_subset=256, test_subset=20000, no_progress=True))
    run.loaders["train"].close(), run.loaders["test"].close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note: ")]
    assert said == ["note: test_subset=20000 is over the 10000 test examples: taking all of them"], said
    assert len(run.data["test"]) == 10000 and len(run.data["train"]) == 256


def test_outputs_that_cannot_be_opened_leave_the_run_directory_unclaimed(tmp_path):
    import types

    from jaxtrain.driver import run_outputs
    from jaxtrain.driver.outputs import claim_out_dir

    def no_room(state):
        raise jt.ConfigError("no room")

    run = types.SimpleNamespace(config=RunConfig(out=str(tmp_path / "out")),
                                checkpointer=types.SimpleNamespace(ensure_room=no_room))
    files = run_outputs.Files()
    with pytest.raises(jt.ConfigError, match="no room"):
        files.start(run, None, None)
    files.close(None)  # as train closes an output whose start failed: nothing left to release
    claim_out_dir(str(tmp_path / "out"), "lenet", False)[1].release()  # was: in use by this very process


def test_a_run_config_is_one_frozen_section_per_concern():
    """Made from the settings by name, held in sections (the recipe's defaults filled in first); each section is
    what its subsystem takes; ``config.lr`` reads ``config.optim.lr``; ``replace`` makes a new one, checked."""
    import dataclasses
    import inspect

    from jaxtrain.driver import sections

    c = RunConfig(model="vit", devices=2, strategy="ring", lr=0.01, checkpoint_dir="ck", log_every=5)
    assert c.parallel == sections.Parallel(devices=2, strategy="ring")
    assert c.optim.lr == c.lr == 0.01 and c.optim.optimizer == models.MODELS["vit"].optimizer
    assert (c.network.model, c.checkpoint.checkpoint_dir, c.observe.log_every) == ("vit", "ck", 5)
    assert [type(getattr(c, name)) for name in sections.SECTIONS] == list(sections.SECTIONS.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.parallel.devices = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.optim = sections.Optim()
    four = c.replace(devices=4)
    assert (four.parallel.devices, c.parallel.devices, four.optim) == (4, 2, c.optim)
    with pytest.raises(jt.ConfigError, match="devices=0"):
        c.replace(devices=0)
    assert list(c.flat()) == list(sections.FIELDS) and c.flat()["strategy"] == "ring"
    assert dataclasses.replace(c, lr=0.1) == c.replace(lr=0.1)  # whole sections given, the named setting wins
    assert RunConfig(model="vit", parallel=c.parallel, optim=c.optim, lr=0.5).parallel.strategy == "ring"
    assert sorted(sections.ORDER) == sorted(sections.FIELDS)  # the command line's order holds every setting once
    inspect.signature(RunConfig).bind("resnet18", 2)  # as RunConfig("resnet18", 2) takes them
    with pytest.raises(AttributeError, match="no attribute 'strategyy'"):
        c.strategyy


def test_help_lists_the_flags_by_section():
    import re

    from jaxtrain.driver.config import flag
    from jaxtrain.driver.sections import FIELDS, SECTIONS

    text = cli.make_parser().format_help()
    heads = {name: text.index(f"\n{name}:\n") for name in SECTIONS}
    assert list(heads.values()) == sorted(heads.values())  # in the sections' order
    ends = dict(zip(SECTIONS, [*list(heads.values())[1:], len(text)]))
    for name, (section, _) in FIELDS.items():
        at = re.search(rf"\n  {flag(name)}[ \n]", text).start()  # where its flag is listed
        assert heads[section] < at < ends[section], name


def test_a_run_config_takes_its_fields_by_name_or_in_order_and_checks_each_first():
    assert RunConfig("resnet18", 2) == RunConfig(model="resnet18", devices=2)
    with pytest.raises(TypeError, match="each once"):
        RunConfig("lenet", model="vit")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'batchsize' \(did you mean "
                                        r"'batch_size'\?\), 'zzz'$"):
        RunConfig(batchsize=3, zzz=1)
    with pytest.raises(jt.ConfigError, match="lr=-1: expected a number > 0.0"):  # a field's own check first
        RunConfig(dataset="bogus", lr=-1)
    with pytest.raises(jt.ConfigError, match="epochs=0"):
        RunConfig(epochs=0, image_size=32)
    with pytest.raises(jt.ConfigError, match="model=None: not one of lenet"):
        RunConfig(model=None)


@needs_fashion_mnist
def test_a_run_leaves_what_its_outputs_say_and_with_none_writes_nothing(tmp_path):
    """``train(build(config), outputs)``: each output is started, its hooks run in the loop, it is finished with
    the summary and closed last, told the error that ended a run; with no outputs the run writes no file (its
    ``--out`` is not even made) and returns its summary."""
    from jaxtrain.driver.build import build
    from jaxtrain.driver.run_outputs import Output
    from jaxtrain.driver.runner import train

    calls = []

    class Watch(Output):
        def __init__(self, fail_at=None):
            self.fail_at = fail_at

        def start(self, run, state, position):
            calls.append(("start", position))

        def hooks(self, run, peak):
            def seen(loop):
                calls.append(("epoch", loop.epoch))
                if loop.epoch == self.fail_at:
                    raise RuntimeError("a hook failed")
            return [Hook(seen, unit="epoch")]

        def finish(self, run, summary, state):
            calls.append(("finish", summary["steps"]))

        def close(self, error):
            calls.append(("close", error))

    run = build(RunConfig("lenet", devices=2, epochs=2, train_subset=512, test_subset=256, out=str(tmp_path / "out")))
    try:
        summary = train(run, outputs=[Watch()])
        assert calls == [("start", None), ("epoch", 1), ("epoch", 2), ("finish", summary["steps"]), ("close", None)]
        assert summary["steps"] == 4 and summary["test_acc"] > 0 and not (tmp_path / "out").exists()
        calls.clear()
        with pytest.raises(RuntimeError, match="a hook failed") as failed:
            train(run, outputs=[Watch(fail_at=1)])
        assert calls == [("start", None), ("epoch", 1), ("close", failed.value)]
    finally:
        run.loaders["train"].close(), run.loaders["test"].close()


@needs_fashion_mnist
def test_a_finished_run_resumed_from_python_returns_its_digest_and_test_numbers(tmp_path):
    """A new user's finding: ``jt.run`` of a finished run returned ``{already_finished, steps, test_acc}`` alone,
    so ``summary["params_digest"]`` raised KeyError."""
    from jaxtrain.driver.build import build
    from jaxtrain.driver.runner import train

    config = RunConfig("lenet", devices=2, epochs=1, train_subset=512, test_subset=256,
                       checkpoint_dir=str(tmp_path / "ck"))
    run = build(config)
    try:
        first = train(run, outputs=[])
    finally:
        run.loaders["train"].close(), run.loaders["test"].close()
    again = jt.run(config.replace(resume=True))
    assert again["already_finished"] and again["steps"] == first["steps"] == 2
    assert (again["params_digest"], again["test_acc"]) == (first["params_digest"], first["test_acc"])
    assert again["test_loss"] == pytest.approx(first["test_loss"], rel=1e-6)


@needs_fashion_mnist
def test_a_run_warns_of_a_mesh_axis_nothing_uses_once(capsys):
    """A new user's finding: a run said it twice (the steps made only to check the settings said it too)."""
    from jaxtrain.driver.build import build

    with cli.library_log():
        run = build(RunConfig("lenet", devices=2, mesh={"model": 2}, train_subset=256, test_subset=256))
        run.loaders["train"].close(), run.loaders["test"].close()
    assert capsys.readouterr().err.count("mesh axis 'model' (2 devices) is used by no parameter rule") == 1


@needs_fashion_mnist
@pytest.mark.parametrize("max_steps, says", [(3, " (projected from 1 step) on"), (4, " on")])
def test_a_rate_from_an_epoch_cut_short_is_said_to_be_projected(caplog, max_steps, says):
    """A new user read a --max-steps run's sec/epoch as an epoch timed; the review: an epoch cut short after the
    first (whose rate alone is timed) too."""
    from jaxtrain.driver.build import build
    from jaxtrain.driver.runner import train

    caplog.set_level(logging.INFO, logger="jaxtrain")
    run = build(RunConfig("lenet", devices=2, epochs=2, max_steps=max_steps, train_subset=512, test_subset=256))
    try:
        train(run, outputs=[])  # 2 steps an epoch: the second epoch cut short at step 3, or whole at 4
    finally:
        run.loaders["train"].close(), run.loaders["test"].close()
    (line,) = [r.getMessage() for r in caplog.records if "sec/epoch" in r.getMessage()]
    assert re.search(r"sec/epoch" + re.escape(says) + " 2 devices", line), line


def test_what_jax_compiles_as_calls_are_made_is_off_the_epochs_clock_and_nothing_else(monkeypatch):
    """A new user's finding: with several steps a call, programs first called in a later epoch (a checkpoint's
    cut, a remainder) compiled there, on the clock of the epochs the steady-state speed is read from (13x slow).
    JAX's compile events inside a call's making are a pause; what runs meanwhile is not (a review's finding: a
    pause around the whole dispatch took the first call's run, which a label check waits for, off too)."""
    from jaxtrain.train import feeds, timing

    chrono = timing.Chrono()
    with chrono.compiling():
        jax.monitoring.record_event_duration_secs(timing.COMPILE_EVENTS[2], 5.0)
        jax.monitoring.record_event_duration_secs("/jax/some/other_duration", 7.0)
    jax.monitoring.record_event_duration_secs(timing.COMPILE_EVENTS[0], 11.0)  # outside: not this clock's
    assert chrono.pauses == {"compile": 5.0}

    trainer, state, train, evaluator, test = _setup()  # 8 steps per epoch
    run, calls = feeds.HostFeed.run, []

    def compiles_at_step_10(self, state, size, batches):  # as if a program were first called there
        calls.append(size)
        if sum(calls) == 10:
            jax.monitoring.record_event_duration_secs(timing.COMPILE_EVENTS[2], 100.0)
        return run(self, state, size, batches)

    monkeypatch.setattr(feeds.HostFeed, "run", compiles_at_step_10)
    cuts = checkpoint_hooks(lambda s, p: None, every=5)
    _, history, _ = fit(trainer, state, train, evaluator, test, epochs=2, hooks=cuts, progress=False, steps_per_call=3)
    assert sum(calls) == 16 and history[0].compile_sec > 0  # epoch 1 compiled its calls' programs (3, 2, 1)
    assert history[1].compile_sec == 100.0 and history[1].train_sec < 0  # epoch 2: none but the one made up


def test_fit_from_a_position_evaluated_at_max_steps_returns_its_history_whole():
    """A review's finding: ``fit(position=...)`` of a run evaluated at max_steps mid-epoch returned the history
    without that epoch (it is in the position's result alone)."""
    trainer, state, train, evaluator, test = _setup()  # 8 steps per epoch
    saved = []
    _, history, _ = fit(trainer, state, train, evaluator, test, epochs=2, max_steps=6, progress=False,
                        hooks=checkpoint_hooks(lambda s, p: saved.append(p)))
    again_state, again, _ = fit(trainer, state, train, evaluator, test, epochs=2, max_steps=6, progress=False,
                                position=saved[-1])
    assert [h.steps for h in again] == [h.steps for h in history] == [6]
    assert again[-1].test_acc == history[-1].test_acc


@pytest.mark.parametrize(("platform", "xla_flags", "said"), [
    ("gpu", "", ", command buffers: XLA's own"),
    ("gpu", "--xla_gpu_enable_command_buffer=", ", command buffers: off"),
    ("cpu", "--xla_gpu_enable_command_buffer=", None),  # a CPU has none: nothing said
])
def test_the_first_line_names_a_gpus_command_buffers(monkeypatch, platform, xla_flags, said):
    from types import SimpleNamespace

    from jaxtrain.driver import report

    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    c = RunConfig(devices=1)
    line = report.describe(c, models.get("lenet"), [SimpleNamespace(platform=platform)], jt.make_mesh(1),
                           {"sharded": [], "replicated": ["w"]}, None, {"train": [0] * 8, "test": [0] * 2}, None)
    assert re.search(re.escape(said) + "[,;]", line) if said else "command buffers" not in line, line
