"""Calls of several steps in ``fit`` (jaxtrain.train.calls, feeds): where calls are cut, what hooks see, the data
on the device, the dispatches an epoch makes. The K-step call itself is tests/test_steps_per_call.py's."""

import json
import math
import os
import signal
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, cached_compiles, needs_fashion_mnist, run_cli, unavailable

import jaxtrain as jt
from jaxtrain.data import loader, sources
from jaxtrain.train import calls, feeds
from jaxtrain.train.loop import Hook, Interrupted, checkpoint_hooks, fit


@pytest.mark.parametrize("start, done, epoch_steps, max_steps, periods, k, want", [
    (0, 0, 10, None, [], 4, [4, 4, 2]),  # the epoch's remainder last
    (0, 10, 10, None, [], 4, [4, 4, 2]),  # every epoch the same calls
    (0, 0, 10, None, [3], 4, [3, 1, 2, 2, 1, 1]),  # a checkpoint every 3 steps cuts: 3, 4(K), 6, 8(K), 9, 10
    (6, 6, 10, None, [3], 4, [2, 1, 1]),  # resumed at step 6: the uninterrupted run's calls from there
    (0, 0, 10, 7, [], 4, [4, 3]),  # max_steps ends the last call
    (0, 0, 5, None, [], 1, [1, 1, 1, 1, 1]),
    (3, 3, 3, None, [], 4, []),
])
def test_calls_are_cut_where_a_hook_is_due_and_at_multiples_of_k(start, done, epoch_steps, max_steps, periods, k,
                                                                 want):
    assert calls.call_sizes(start, done, epoch_steps, max_steps, periods, k) == want


def test_calls_end_after_a_profiles_start_and_stop():
    assert calls.call_sizes(0, 0, 20, None, [], 8, points=[9, 14]) == [8, 1, 5, 2, 4]  # 8, 9, 14, 16, 20
    assert calls.call_sizes(0, 10, 10, None, [], 8, points=[9, 14]) == [4, 4, 2]  # 14 (batch 4), 18, 20


def test_a_resumed_epoch_makes_the_uninterrupted_calls_from_any_boundary():
    whole = calls.call_sizes(0, 20, 10, None, [3, 5], 4)
    ends = np.cumsum(whole)
    for end in ends[:-1]:
        assert calls.call_sizes(int(end), 20 + int(end), 10, None, [3, 5], 4) == whole[list(ends).index(end) + 1:]


def test_host_batches_are_stacked_per_call_and_a_metric_row_per_step():
    batches = [{"x": np.full(2, i)} for i in range(5)]
    got = list(calls.stacked(batches, [1, 3, 1]))
    assert [k for k, _ in got] == [1, 3, 1]
    assert got[1][1]["x"].tolist() == [[1, 1], [2, 2], [3, 3]] and got[2][1]["x"].tolist() == [4, 4]
    assert calls.rows({"loss": np.array([1.0, 2.0])}, 2) == [{"loss": 1.0}, {"loss": 2.0}]


def mlp_loss(params, model_state, batch, rng):
    """Dense layers only: XLA compiles a scan's body as it compiles one step, so K steps are K calls bit for bit."""
    x = batch["image"].reshape(len(batch["image"]), -1)
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    labels = jax.nn.one_hot(batch["label"], 10)
    loss = optax.softmax_cross_entropy(logits, labels).mean()
    return loss, (model_state, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])})


def mlp_eval(params, model_state, batch):
    x = batch["image"].reshape(len(batch["image"]), -1)
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["label"], 10))
    return {"loss": loss, "accuracy": (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)}


def setup(n_train=1024, batch=64, augment="crop+flip", strategy="jit"):
    rng = np.random.default_rng(0)
    split = sources.Split(rng.integers(0, 256, (n_train, 12, 12, 1), dtype=np.uint8),
                          rng.integers(0, 10, n_train).astype(np.int32))
    params = {"w1": jax.random.normal(jax.random.key(1), (144, 32)) * 0.1,
              "w2": jax.random.normal(jax.random.key(2), (32, 10)) * 0.1}
    trainer = jt.make_train_step(mlp_loss, optax.sgd(0.1, momentum=0.9), mesh=2, strategy=strategy)
    state = trainer.init(params)
    return (trainer, state, loader.Loader(split, batch, train=True, augment=augment, seed=3),
            jt.make_eval_step(mlp_eval, trainer=trainer), loader.Loader(split.head(200), 64, train=False))


def digest(state):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get((state.params, state.opt_state)))]


@pytest.mark.parametrize("k, on_device", [(4, False), (1, True), (5, True)])
def test_k_steps_a_call_and_the_data_on_the_device_give_one_step_a_calls_state_bit_for_bit(k, on_device):
    trainer, state, train, evaluator, test = setup()
    want, want_history, _ = fit(trainer, state, train, evaluator, test, epochs=2, progress=False)
    trainer, state, train, evaluator, test = setup()
    got, history, _ = fit(trainer, state, train, evaluator, test, epochs=2, progress=False, steps_per_call=k,
                          data_on_device=on_device)
    assert digest(got) == digest(want)
    assert [(h.steps, h.train_loss, h.test_acc) for h in history] == [
        (h.steps, h.train_loss, h.test_acc) for h in want_history]


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_every_strategy_trains_on_the_data_on_the_device_as_on_the_hosts(strategy):
    trainer, state, train, evaluator, test = setup(n_train=512, strategy=strategy)
    want, want_history, _ = fit(trainer, state, train, evaluator, test, epochs=1, progress=False)
    trainer, state, train, evaluator, test = setup(n_train=512, strategy=strategy)
    got, history, _ = fit(trainer, state, train, evaluator, test, epochs=1, progress=False, steps_per_call=3,
                          data_on_device=True)
    assert digest(got) == digest(want)
    assert history[0].test_acc == want_history[0].test_acc


def test_hooks_see_the_steps_they_name_with_several_steps_a_call():
    trainer, state, train, evaluator, test = setup()  # 16 steps per epoch
    seen, saved = [], []
    hooks = [Hook(lambda loop: seen.append(loop.total_steps), every=6),
             *checkpoint_hooks(lambda s, p: saved.append((int(s.step), p.total_steps, p.batch)), every=5)]
    fit(trainer, state, train, None, test, epochs=2, max_steps=23, hooks=hooks, progress=False, steps_per_call=4)
    assert seen == [6, 12, 18]
    assert saved == [(5, 5, 5), (10, 10, 10), (15, 15, 15), (16, 16, 0), (20, 20, 4), (23, 23, 7)]


def test_a_stop_request_is_read_after_the_call_in_flight():
    trainer, state, train, evaluator, test = setup()
    requests = iter([False, True])
    hooks = checkpoint_hooks(lambda s, p: None, should_stop=lambda: next(requests))
    with pytest.raises(Interrupted) as stopped:
        fit(trainer, state, train, evaluator, test, epochs=1, hooks=hooks, progress=False, steps_per_call=4)
    assert stopped.value.position.total_steps == 8  # asked during the second call: it ran to its end


def test_a_steps_work_is_measured_on_a_call_laid_out_straight_on_a_cpu(monkeypatch):
    """``busy.per_step_in_call`` (``--steps-per-call auto``, bench_busy's work per step) times its steps laid out
    straight where compiled for a CPU (``unroll=None``), not in a loop whose convolutions run other, far slower
    kernels there (ResNet-18's: 7.1 s a step against 0.15)."""
    from jaxtrain.driver import busy

    trainer, state, train, _, _ = setup()
    unrolls, placed_steps = [], trainer.placed_steps

    def recorded(state, batches, **kw):
        unrolls.append(kw.get("unroll", False))
        return placed_steps(state, batches, **kw)

    monkeypatch.setattr(trainer, "placed_steps", recorded)
    work = busy.per_step_in_call(trainer, state, train.batch_at(0, 0), repeats=1)
    assert unrolls and set(unrolls) == {None} and work >= 0.0


def test_an_epoch_makes_one_call_per_k_steps(monkeypatch):
    trainer, state, train, evaluator, test = setup()  # 16 steps per epoch
    dispatched = []
    for name in ("step", "placed_steps"):
        method = getattr(trainer, name)
        monkeypatch.setattr(trainer, name, lambda s, b, method=method, name=name: (dispatched.append(name),
                                                                                    method(s, b))[1])
    fit(trainer, state, train, None, test, epochs=1, progress=False, steps_per_call=6, data_on_device=True)
    assert len(dispatched) == math.ceil(16 / 6) and dispatched == ["placed_steps"] * 3  # 6, 6, 4


def test_with_the_data_on_the_device_nothing_crosses_from_the_host_in_an_epoch(monkeypatch):
    """The loop refuses even an explicit copy from the host while a call is fetched and run: a step that copied
    one fails, so a run that finishes copied none."""
    trainer, state, train, evaluator, test = setup()
    fit(trainer, state, train, evaluator, test, epochs=1, progress=False, steps_per_call=4, data_on_device=True)
    run = feeds.HostFeed.run  # what the device feed calls with the batches it gathered
    monkeypatch.setattr(feeds.HostFeed, "run", lambda self, s, k, b: run(self, s, k, {
        **b, "label": jax.device_put(np.zeros(b["label"].shape, np.int32))}))  # a host array copied in
    trainer, state, train, evaluator, test = setup()
    with pytest.raises(Exception, match="host-to-device transfer"):
        fit(trainer, state, train, evaluator, test, epochs=1, progress=False, steps_per_call=4, data_on_device=True)


def test_a_non_finite_loss_names_its_step_inside_a_call():
    trainer, state, train, evaluator, test = setup()

    def update(updates, count, params=None):
        bad = jnp.where(count + 1 == 6, jnp.nan, 0.0)  # the update of step 6 is NaN: step 7's loss is
        return jax.tree.map(lambda u: u + bad, updates), count + 1

    tx = optax.chain(optax.sgd(0.1), optax.GradientTransformation(lambda p: jnp.zeros([], jnp.int32), update))
    trainer = jt.make_train_step(mlp_loss, tx, mesh=2)
    state = trainer.init(jax.device_get(state.params))
    from jaxtrain.errors import Diverged
    with pytest.raises(Diverged, match="the loss became nan at step 7"):
        fit(trainer, state, train, evaluator, test, epochs=1, progress=False, steps_per_call=4)


@pytest.mark.slow
@needs_fashion_mnist
def test_a_run_stopped_in_a_call_resumes_to_the_uninterrupted_runs_digest(tmp_path):
    """SIGTERM while calls of 4 steps run, with a checkpoint every 3 steps (not a multiple of 4): the run stops at
    the end of the call in flight, saves, and resumed ends with the digest of the run never stopped, which is
    also the digest of one step a call with host data (oneDNN's fp32 convolutions: the same bits)."""
    from jaxtrain.kernels import onednn

    if not onednn.available():
        unavailable(f"oneDNN's convolutions: {onednn.reason()}")
    run = ["-m", "experiments.lenet", "--devices", "2", "--train-subset", "2560", "--test-subset", "256",
           "--epochs", "2", "--augment", "crop+flip", "--no-progress"]  # 10 steps an epoch
    busy = [*run, "--steps-per-call", "4", "--data-on-device", "on"]
    for name, args in (("today", [*run, "--steps-per-call", "1", "--data-on-device", "off"]), ("full", busy)):
        done = run_cli(*args, "--out", str(tmp_path / name))
        assert done.returncode == 0, done.stderr[-3000:]
    ck, out = tmp_path / "ck", tmp_path / "out"
    env = {k: v for k, v in cached_compiles(os.environ).items() if k != "JAX_NUM_CPU_DEVICES"}
    proc = subprocess.Popen([sys.executable, *busy, "--checkpoint-every", "3", "--checkpoint-dir", str(ck),
                             "--out", str(out), "--log-every", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the first step line: a call has been read, the run is in its calls
        if re.match(r"step \d+: loss", line):
            break
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    resumed = run_cli(*busy, "--checkpoint-every", "3", "--checkpoint-dir", str(ck), "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step" in resumed.stdout
    digests = {name: json.loads((tmp_path / name / "summary.json").read_text())["params_digest"]
               for name in ("today", "full", "out")}
    assert len(set(digests.values())) == 1, digests
