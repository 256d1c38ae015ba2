"""Watching a run: step lines, TensorBoard events, a profiler trace of chosen steps (hooks for ``fit``).

Step numbers are read one step late (``loop.recent``): logging never waits
for the device. TensorBoard events are written with tensorboard's own record writer (no
TensorFlow); ``tensorboard --logdir RUN_DIR`` shows them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import jax

from jaxtrain.driver.config import parse_steps
from jaxtrain.driver.sections import Observe
from jaxtrain.driver.language import perplexity
from jaxtrain.errors import missing
from jaxtrain.models.flops import TRAIN_FACTOR
from jaxtrain.train.loop import Hook, Loop, evaluation

log = logging.getLogger(__name__)


class Events:
    """TensorBoard event files in ``log_dir``: step and epoch scalars, the config as text.

    Written in line (no writer thread), flushed at each epoch's end. They are a
    view of the run, not its record: if a write fails (full disk), one warning
    says so and the run goes on without them (metrics.jsonl and checkpoints
    report their own failures).
    """

    def __init__(self, log_dir: Path, config: dict):
        self.broken = False
        self._guard(self._open, log_dir, config)

    def _open(self, log_dir, config):
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.record_writer import RecordWriter

        path = log_dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.writer = RecordWriter(open(path, "ab"))  # noqa: SIM115 - closed in close()
        self._write(0, None, file_version="brain.Event:2")
        self._write(0, text_pb("config", "```\n" + json.dumps(config, indent=2, sort_keys=True, default=str) + "\n```"))

    def _write(self, step, summary, **fields):
        from tensorboard.compat.proto import event_pb2

        self.writer.write(event_pb2.Event(wall_time=time.time(), step=step, summary=summary, **fields)
                          .SerializeToString())

    def _guard(self, fn, *args):
        if self.broken:
            return
        try:
            fn(*args)
        except OSError as e:
            self.broken = True
            log.warning(f"TensorBoard events not written from here on ({e.strerror or e})")

    def scalars(self, step: int, values: dict, prefix: str) -> None:
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb

        for k, v in values.items():
            self._guard(self._write, step, scalar_pb(f"{prefix}/{k}", float(v)))

    def flush(self) -> None:
        self._guard(lambda: self.writer.flush())

    def close(self) -> None:
        self._guard(lambda: self.writer.close())


class Views(list):
    """The scalars' views (TensorBoard's Events, a --track tracker): each gets every value."""

    def scalars(self, step: int, values: dict, prefix: str) -> None:
        for view in self:
            view.scalars(step, values, prefix)

    def flush(self) -> None:
        for view in self:
            view.flush()


def step_log(every: int, say, views: Views | None, seq_len: int | None = None,
             flops_per_example: float | None = None, peak: float | None = None) -> Hook:
    """Every ``every`` steps: one line (loss, examples/s, data wait since the last line) and step scalars; a
    language model's (``seq_len``: its window) with the loss's perplexity and tokens/s; the MFU where the
    devices' ``peak`` FLOP/s is known (GPUs, --measure-peak), from the model's forward ``flops_per_example``."""
    last = {"sec": None, "examples": 0, "wait": 0.0}
    mfu_per_example = TRAIN_FACTOR * flops_per_example / peak if flops_per_example and peak else None  # x ex/s

    def log(loop: Loop) -> None:
        if not loop.recent:
            return  # nothing read yet (the first step of a run)
        sec, examples, wait = loop.chrono.train_sec, loop.sums["examples"], loop.chrono.wait + loop.chrono.start_up
        if last["sec"] is None or sec < last["sec"]:  # a new epoch's clock
            last.update(sec=0.0, examples=0, wait=0.0)
        dt = max(sec - last["sec"], 1e-9)
        values = {"loss": float(loop.recent["loss"]), "examples_per_sec": (examples - last["examples"]) / dt,
                  "data_wait_fraction": (wait - last["wait"]) / dt,
                  **({"lr": float(loop.recent["lr"])} if "lr" in loop.recent else {})}
        last.update(sec=sec, examples=examples, wait=wait)
        step = loop.total_steps - loop.call_size  # the step these metrics are of: the previous call's last
        lr = f", lr {values['lr']:.4g}" if "lr" in values else ""
        if seq_len:
            values["tokens_per_sec"] = values["examples_per_sec"] * seq_len
            speed = f" ({perplexity(values['loss'])}){lr}, {values['tokens_per_sec']:,.0f} tokens/s"
        else:
            speed = f"{lr}, {values['examples_per_sec']:,.0f} examples/s"
        if mfu_per_example and values["examples_per_sec"]:  # none since the last line (a resume's first): none said
            values["mfu"] = mfu_per_example * values["examples_per_sec"]
            speed += f", MFU {values['mfu']:.1%}"
        say(f"step {step}: loss {values['loss']:.4f}{speed}, data wait {100 * values['data_wait_fraction']:.0f}%")
        if views is not None:
            views.scalars(step, values, "train_step")

    return Hook(log, every, cuts=False)  # a call of several steps is not cut for a line: it comes after it


def eval_line(say, views: Views | None):
    """``on_result`` of a step-period ``evaluation``: one line and ``test_step/`` scalars."""
    def show(loop: Loop, result: dict) -> None:
        say(f"step {result['step']}: test loss {result['loss']:.4f}, test acc {result['accuracy']:.3f} "
            f"({result['count']} examples, {result['sec']:.1f} s)")
        if views is not None:
            views.scalars(result["step"], {"loss": result["loss"], "accuracy": result["accuracy"]}, "test_step")

    return show


def epoch_scalars(views: Views) -> Hook:
    def write(loop: Loop) -> None:
        s = loop.stats
        tested = {"test_loss": s.test_loss, "test_acc": s.test_acc} if s.test_examples else {}
        views.scalars(s.epoch, {"train_loss": s.train_loss, "train_acc": s.train_acc, **tested,
                                 "train_sec": s.train_sec, "data_wait_fraction": s.data_wait_fraction}, "epoch")
        views.flush()

    return Hook(write, unit="epoch")


class Profile:
    """A ``jax.profiler`` trace of steps START..STOP-1 into ``log_dir`` (XProf / TensorBoard's profile plugin
    layout, plus a Perfetto trace); the loop's named scopes (data_wait, train_step, eval) are in it."""

    def __init__(self, log_dir: Path, start: int, stop: int):
        self.log_dir, self.start, self.stop, self.active = log_dir, start, stop, False

    def hook(self) -> Hook:
        return Hook(self._on_step, cuts=False, at=(self.start - 1, self.stop - 1))  # calls end there

    def _on_step(self, loop: Loop) -> None:
        # Called after step N was dispatched (a call of several steps ends after START-1 and STOP-1): starting
        # here traces steps N+1 ...
        if loop.total_steps == self.start - 1:  # (START 1: begin() before the loop)
            self.begin()
        elif loop.total_steps == self.stop - 1 and self.active:
            loop.sync()  # the traced steps have run
            self.end()

    def begin(self) -> None:
        if not self.active:
            jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=True)
            self.active = True

    def end(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def watchers(o: Observe, out_dir: Path | None, say, evaluator=None, test_loader=None, tracker=None, *,
             hparams: dict, prefetch: int = 2, seq_len: int | None = None, flops_per_example: float | None = None,
             peak: float | None = None) -> tuple[list[Hook], Profile | None, Events | None]:
    """The hooks that --log-every, --eval-every-steps, --profile, the TensorBoard events (``hparams``: the run's
    settings) and ``tracker`` (--track: jaxtrain.driver.track) ask for (files on process 0 only); ``prefetch``:
    the step evaluation's batches ahead; ``seq_len``: a language model's (tokens/s); ``flops_per_example`` and
    ``peak``: the log lines' MFU (``step_log``). The caller closes the events and the tracker."""
    events = None
    if out_dir is not None and (gone := missing("tensorboard", "TensorBoard events")):
        say(f"note: {gone}")
    elif out_dir is not None:
        events = Events(out_dir, hparams)
    views = Views(v for v in (events, tracker) if v is not None) or None
    hooks = [epoch_scalars(views)] if views else []
    if o.log_every:
        hooks.append(step_log(o.log_every, say, views, seq_len, flops_per_example, peak))
    if o.eval_every_steps:
        hooks.append(evaluation(evaluator, test_loader, o.eval_every_steps, "step", prefetch, eval_line(say, views)))
    profile = None
    if o.profile:
        profile = Profile((out_dir or Path("profile")) / "profile", *parse_steps(o.profile))
        hooks.append(profile.hook())
    return hooks, profile, events
