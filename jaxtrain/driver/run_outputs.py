"""What a run leaves, as ``Output``s that ``runner.train`` calls at each point of the run: its files (metrics,
summary, curves), its tracker, its TensorBoard events, step log lines and profile, its checkpoints, its model, a
language model's samples.

    train(run, outputs):  start(run, state, position) -> the loop's hooks (``hooks``) -> fit -> trained()
                          -> finish(run, summary, state) -> close(error), always
    a run found finished: found_finished(run, summary, state) alone

``command_outputs`` makes the command line's. A Python caller may pass others, or none at all
(``train(build(config), outputs=[])``): a run that writes no file and returns its summary. Its lines are still
said (the ``jaxtrain`` logger's: route or silence it), and what only an output does is not done (``--log-every``,
``--eval-every-steps``, ``--profile``, ``--track``: ``Observing``'s and ``Tracking``'s).
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np

from jaxtrain.driver import distill, export, language, notebook, observe, requeue, track
from jaxtrain.driver.build import Run, say
from jaxtrain.driver.outputs import OutputError, RunWriter, claim_out_dir, write_summary
from jaxtrain.driver.report import forward_flops
from jaxtrain.driver.signals import Exit
from jaxtrain.settings import slurm_job
from jaxtrain.train.loop import Hook

log = logging.getLogger(__name__)


class Output:
    """One thing a run leaves; every method is optional (this class's do nothing)."""

    def start(self, run: Run, state, position) -> None:
        """Before the run's first line: the state it starts from (``position``: a resumed run's, else None)."""

    def hooks(self, run: Run, peak: float | None) -> list[Hook]:
        """The loop's hooks (every N steps or epochs), asked once, as training starts (``peak``: the devices'
        dense FLOP/s, ``diagnostics.devices_peak``; None: unknown)."""
        return []

    def trained(self) -> None:
        """The loop ended, however (finished, stopped, failed), before the summary's work."""

    def stopped(self, step: int, signal_name: str, saved: bool) -> None:
        """A signal stopped training at ``step`` (``saved``: its checkpoint was written)."""

    def finish(self, run: Run, summary: dict, state) -> None:
        """Training ended: the run's summary and its final state."""

    def found_finished(self, run: Run, summary: dict, state) -> None:
        """The run had ended before (its last checkpoint says so): its summary and state, nothing trained; no
        other method is called."""

    def close(self, error: BaseException | None) -> None:
        """Last, always, once started (a start that failed too): ``error`` the exception that ended the run, else
        None."""


class Files(Output):
    """The run directory (process 0's): claimed at the start, metrics.jsonl after each epoch (and a notebook's
    curves redrawn), a stop's record (and its requeue: ``requeue_job``), summary.json and curves.png at the end."""

    def __init__(self, requeue_job: dict | None = None):
        self.requeue_job = requeue_job
        self.writer: RunWriter | None = None
        self._lock = None

    @property
    def out_dir(self) -> Path | None:
        return self.writer and self.writer.out_dir

    def start(self, run, state, position):
        if jax.process_index() != 0:
            return
        c = run.config
        resumed = position is not None
        out_dir, self._lock = claim_out_dir(c.out, c.model, resumed, c.checkpoint_dir if c.resume and not resumed
                                            else None)
        try:
            if run.checkpointer is not None:  # room for the checkpoints to come, checked now
                run.checkpointer.ensure_room(state)
            self.writer = RunWriter(out_dir, position.history if position else (), slurm_job(),
                                    resumed=bool(position))
        except BaseException:  # no room, or the files cannot be written: the directory is not left claimed
            self._lock.release()
            self._lock = None
            raise

    def hooks(self, run, peak):
        if self.writer is None:
            return []
        live = notebook.live_curves(lambda: self.writer.epochs)  # after the epoch's row is written
        return [Hook(lambda loop: self.writer.epoch(loop.stats), unit="epoch"), *([live] if live else [])]

    def stopped(self, step, signal_name, saved):
        requeue.after_stop(self.requeue_job, self.writer, step, signal_name, say, saved)

    def finish(self, run, summary, state):
        if self.writer is None:
            return
        summary["stops"] = self.writer.stops
        self.writer.summary(summary)
        say(f"wrote {self.out_dir}/summary.json, metrics.jsonl{'' if self.writer.no_plot else ', curves.png'}")

    def found_finished(self, run, summary, state):
        out = run.config.out
        if out is None or jax.process_index() != 0 or (Path(out) / "summary.json").exists():
            return
        say(f"its summary was never written to {out}: writing what its checkpoint holds (the result, its digest; "
            "not the timings)")  # a full disk, or a kill, between the run's last checkpoint and its summary
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            write_summary(Path(out), {**summary, "from_checkpoint": True})
        except (OSError, OutputError) as e:  # said; the model is still written (every process joins its save)
            log.warning(f"{out}/summary.json not written: {e}")

    def close(self, error):
        if self._lock is not None:
            self._lock.release()


class Tracking(Output):
    """``--track``'s tracker (wandb, MLflow) beside the run directory of ``files``: the run's settings at the
    start, its scalars through ``Observing``, its summary and curves at the end; closed as killed or failed by
    an error."""

    def __init__(self, files: Files):
        self.files = files
        self.tracker = None

    def start(self, run, state, position):
        c = run.config
        if c.track != "none" and self.files.out_dir is not None:
            self.tracker = track.start(c.track, self.files.out_dir, {**c.flat(), **run.settings}, c.track_group,
                                       resumed=bool(position))

    def finish(self, run, summary, state):
        if self.tracker is not None:
            self.tracker.finish(summary, [self.files.out_dir / "curves.png"])

    def close(self, error):
        if self.tracker is not None and error is not None:
            self.tracker.close("killed" if isinstance(error, (Exit, KeyboardInterrupt)) else "failed")


class Observing(Output):
    """What ``--log-every``, ``--eval-every-steps``, ``--profile`` and the TensorBoard events ask for
    (``observe.watchers``), written beside ``files``' and to ``tracking``'s tracker."""

    def __init__(self, files: Files, tracking: Tracking):
        self.files, self.tracking = files, tracking
        self.profile = self.events = None

    def hooks(self, run, peak):
        c = run.config
        hooks, self.profile, self.events = observe.watchers(
            c.observe, self.files.out_dir, say, run.evaluator, run.loaders["test"], self.tracking.tracker,
            hparams=c.flat(), prefetch=c.prefetch, seq_len=c.seq_len,
            flops_per_example=forward_flops(c, run.model), peak=peak)
        if self.profile and self.profile.start == 1:
            self.profile.begin()
        return hooks

    def trained(self):
        self.close(None)  # the trace ends with the loop (not with the summary's work or the samples after it)

    def close(self, error):
        if self.profile:
            self.profile.end()
        if self.events:
            self.events.close()
            self.events = None


class Model(Output):
    """The finished run's model in ``files``' directory (``export``): RUN_DIR/model/ and model.json, as the
    unpipelined model holds it; a language model's tokenizer beside them. A run found finished whose model was
    never written (killed between its last checkpoint and its export) writes it then."""

    def __init__(self, files: Files):
        self.files = files

    def finish(self, run, summary, state):
        save_model(run, self.files.out_dir, state, summary)

    def found_finished(self, run, summary, state):
        out, first = run.config.out, jax.process_index() == 0
        unsaved = out is not None and first and not export.saved(out)
        if jax.process_count() > 1:  # process 0's finding (the others' disks may hold no run): all join its save
            from jax.experimental import multihost_utils

            unsaved = bool(multihost_utils.broadcast_one_to_all(np.int32(unsaved)))
        if unsaved:
            say(f"its model was never written to {out}: writing it now")
            save_model(run, Path(out) if first else None, state, summary)


class Samples(Output):
    """A language model's last lines: text it samples, from prompts taken from the validation text."""

    def finish(self, run, summary, state):
        if run.tokenizer is None:
            return
        prompts = language.sample_prompts(run.data["test"], run.tokenizer)
        new = min(48, run.model.seq_len // 2)  # a prompt keeps half the context at most: the rest always fits
        for text in language.samples(run.model, in_layer_order(run, state.params), run.tokenizer, prompts, new,
                                     seed=run.config.seed):
            say("sample: " + " ".join(text.split()))


def command_outputs(requeue_job: dict | None = None) -> list[Output]:
    """What a run of the command line leaves: its files, tracker, events and log lines, model and samples (each
    written by process 0; the samples after the model: nothing of the run hangs on them)."""
    files = Files(requeue_job)
    tracking = Tracking(files)
    return [files, tracking, Observing(files, tracking), Model(files), Samples()]


def in_layer_order(run: Run, params: dict) -> dict:
    """A pipelined run's params as the unpipelined model holds them (its blocks stored per stage, ``[repeats,
    stages, K, ...]``, in layer order again: ``[L, ...]``); another run's as they are."""
    if not run.trainer.pipeline_layout:
        return params
    from jaxtrain.train.pipeline import layers

    return {**params, "stages": layers(params["stages"])}


def save_model(run: Run, out_dir, state, summary: dict) -> None:
    """The finished run's model: RUN_DIR/model/ + model.json (jaxtrain.driver.export), as the unpipelined model
    holds it (a pipelined run's blocks in layer order: every reader of a run takes it); a language model's
    tokenizer beside them (``tokenizer.json``: jaxtrain sample reads it)."""
    settings = run.settings
    if run.tokenizer is not None and out_dir is not None:
        run.tokenizer.save(Path(out_dir) / export.TOKENIZER)
    layer_order = {export.LAYER_ORDER: True} if run.trainer.pipeline_layout else {}
    export.save(out_dir, in_layer_order(run, state.params), distill.own_state(state.model_state), {**layer_order,
        **{k: summary.get(k) for k in ("test_acc", "steps")}, "model": run.config.model, "init": run.model.init_name,
        "input_shape": run.model.input_shape, "num_classes": run.model.num_classes, "settings": settings,
        **({"class_names": settings["class_names"]} if "class_names" in settings else {})})
