"""``run(config)``: a whole training run in small phases, each readable alone.

    build(config) -> Run (``jaxtrain.driver.build``: devices, model, checkpoints, data, steps; made once)
    -> train(run, outputs): state (fresh, or resumed) -> each output started -> fit -> summary -> each output
       finished, then closed                                                                        (here)

What a run leaves (its files, tracker, events, model, samples) are ``run_outputs.Output``s. Only process 0 says
the run's progress (logging, ``jaxtrain.io.console``) and writes files; every process trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import signal
from collections.abc import Sequence

import jax

from jaxtrain.analysis import diagnostics
from jaxtrain import errors
from jaxtrain.errors import Diverged
from jaxtrain.io.files import params_digest
from jaxtrain.parallel import hosts
from jaxtrain.settings import slurm_job
from jaxtrain.io import console
from jaxtrain.driver import busy, language, notebook, requeue
from jaxtrain.driver.config import RunConfig
from jaxtrain.driver.report import (conv_path, describe, not_learning, projected_words, run_summary,
                                    utilisation_words, wait_words)
from jaxtrain.driver.run_outputs import Output, command_outputs
from jaxtrain.driver.signals import Exit, StopOnSignal, StopVote
from jaxtrain.driver.build import Finished, Run, build, initial_state, say
from jaxtrain.train.loop import Hook, Interrupted, checkpoint_hooks, fit

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Trained:
    """What ``train`` leaves: the state, the epochs' history and what the summary reads of the training."""

    state: object
    history: list
    first_loss: float | None
    stats: dict  # the compiled step's (``diagnostics.compiled_stats``)
    steps_per_epoch: int
    last: dict  # the last step's metrics
    peak: float | None  # the devices' dense FLOP/s, for the MFU (``diagnostics.devices_peak``; None: unknown)
    steps_per_call: int = 1  # as the run made its calls (``keep_busy``: ``auto`` resolved)
    data_on_device: bool = False


def fit_run(run: Run, state, position, stop: StopOnSignal, outputs: Sequence[Output]) -> Trained:
    """``fit`` with the outputs' hooks, the checkpoints and the signal handling."""
    c, data = run.config, run.data
    train_data, test_data = run.loaders["train"], run.loaders["test"]
    last = {}
    if c.summary:
        inputs = run.model.inputs(test_data.batch_at(0, 0))[:8]
        say(diagnostics.format_summary(diagnostics.summarize(
            state.params, lambda params, x: run.model.logits(params, state.model_state, x), inputs)))
    if c.memory_report:
        say("memory at start:\n" + diagnostics.format_memory_report(diagnostics.memory_report()))
    stats = diagnostics.compiled_stats(run.trainer, state, train_data.batch_at(0, 0))
    if warning := diagnostics.host_memory_warning(stats, run.devices):
        log.warning(warning)
    peak = diagnostics.devices_peak(run.devices, c.precision, measure=c.measure_peak)

    def memory_after_first_step(loop):
        if loop.total_steps == loop.call_size:  # the run's first call (after it: its steps)
            loop.sync()
            first = "step" if loop.call_size == 1 else f"call ({loop.call_size} steps)"
            say(f"memory after the first {first}:\n" + diagnostics.format_memory_report(diagnostics.memory_report()))

    def epoch_line(loop):
        e = loop.stats
        test = f"test acc {e.test_acc:.3f}" if e.test_examples else "not evaluated"
        words = (language.epoch_words(e, run.model.seq_len) if run.tokenizer else
                 f"train loss {e.train_loss:.4f}, train acc {e.train_acc:.3f}, {test}")
        wait = wait_words(e.data_wait_fraction, c.workers)
        say(f"epoch {e.epoch}/{c.epochs}: {words}, {e.train_sec:.1f} sec, {wait}")

    def save(state, position):
        with stop.busy():
            run.checkpointer.save(state, position)

    steps_per_call, on_device = keep_busy(run, state, data["train"], train_data)
    hooks = [*(hook for output in outputs for hook in output.hooks(run, peak)),  # the epoch's row first
             Hook(epoch_line, unit="epoch"),
             *checkpoint_hooks(save if run.checkpointer else None, c.checkpoint_every, stop.requested),
             Hook(lambda loop: last.update(loop.recent), unit="epoch"),  # the last step's metrics
             *([Hook(memory_after_first_step, cuts=False)] if c.memory_report else [])]
    try:
        stop.training(checkpoints=run.checkpointer is not None)
        try:
            state, history, first_loss = fit(
                run.trainer, state, train_data, run.evaluator, test_data, epochs=c.epochs, max_steps=c.max_steps,
                hooks=hooks,
                progress=False if c.no_progress or jax.process_index() != 0 else True if notebook.active() else None,
                prefetch=c.prefetch, position=position, eval_every=c.eval_every, pause=stop.busy,
                steps_per_call=steps_per_call, data_on_device=on_device)
        finally:
            for output in outputs:  # the loop's end, however it ended (a trace stops with its steps)
                output.trained()
    except Interrupted as e:
        stop.done()
        step, signal_name = e.position.total_steps, signal.Signals(stop.signum).name

        def then(saved):
            for output in outputs:
                output.stopped(step, signal_name, saved)

        stop.stopped(step, run.checkpointer, say, then=then)
    except Diverged as e:
        stop.done()
        if run.checkpointer is None:
            raise
        with stop.busy():
            run.checkpointer.close()  # the saves in flight, all of finite states, land
        raise Diverged(e.what, e.step, f"the newest checkpoint is step {run.checkpointer.latest()} in "
                       f"{run.checkpointer.directory}") from None
    stop.done()
    if stop.signum:  # it came after the last call (in the final evaluation): nothing is left to stop
        say(f"{signal.Signals(stop.signum).name} came after the last step: the run ends once its files are written "
            "(a second signal exits now)")
    if run.checkpointer is not None:
        with stop.busy():
            run.checkpointer.close()
    return Trained(state, history, first_loss, stats, len(train_data), last, peak, steps_per_call, on_device)


def keep_busy(run: Run, state, split, train_data) -> tuple[int, bool]:
    """Steps per call and the data's place (``jaxtrain.driver.busy``), said in one line."""
    c, device = run.config, jax.local_devices()[0]
    on_device, where = busy.data_on_device(c.data_on_device, device.platform, split, device)
    k, why = busy.steps_per_call(c.steps_per_call, device.platform,
                                 lambda: busy.per_step_in_call(run.trainer, state, train_data.batch_at(0, 0)))
    k, on_device = busy.agreed(k, on_device)  # process 0's: every process makes the same calls
    say(f"steps per call: {k} ({why}); training data on the {'devices' if on_device else 'host'} ({where})")
    return k, on_device


def recorded(words, *args) -> str:
    """``words(*args)`` as a file records it: naming parameters as Python does (``conv=xla``), whether a command
    line or a Python caller made the run (its log lines say the command's flags)."""
    with errors.flags_spoken(None):
        return words(*args)


def summarise(run: Run, trained: Trained) -> dict:
    """The run's summary (summary.json, written by ``run_outputs.Files``), its result said first (if the files
    fail, the user still has it)."""
    c, platform, data, settings = run.config, run.devices[0].platform, run.data, run.settings
    state, history, first_loss, stats = trained.state, trained.history, trained.first_loss, trained.stats
    summary = run_summary(c, run.model, history, first_loss, stats, trained.peak, run.devices, run.call_batch,
                          trained.steps_per_epoch, {k: len(v) for k, v in data.items()}, settings["data_sha256"])
    summary.update(slurm_job=slurm_job(), stops=[],  # a stop's record: run_outputs.Files's
                   steps_per_call=trained.steps_per_call, data_on_device=trained.data_on_device)  # as resolved
    if "class_names" in settings:  # an image folder's: label i is class_names[i]
        summary["class_names"] = settings["class_names"]
    summary.update(params_digest=params_digest(state.params), mesh=dict(run.mesh.shape),
                   param_sharding=c.param_sharding, sharded_params=run.layout["sharded"],
                   collectives=stats["collectives"],
                   conv=recorded(conv_path, c, run.model, platform),
                   pipeline={**run.trainer.describe(), "counted_bubble": float(trained.last["pipeline_bubble"])}
                   if run.trainer.pipeline_layout else None)
    plural = "s" * (len(run.devices) != 1)
    if run.tokenizer is not None:
        summary.update(language.summary(run.model, data["test"], summary))
        result = (f"test loss {summary['test_loss']:.4f} ({language.perplexity(summary['test_loss'])}; the "
                  f"validation tokens' unigram entropy: {summary['unigram_entropy']:.4f}), "
                  f"{summary['tokens_per_sec']:,.0f} tokens/s")
    else:
        result = f"test acc {history[-1].test_acc:.2f}"
    say(f"{result}, {summary['sec_per_epoch']:.1f} sec/epoch{projected_words(history, trained.steps_per_epoch)} "
        f"on {len(run.devices)} device{plural} ({platform}){utilisation_words(summary)}"
        f"{not_learning(history, first_loss, run.model.num_classes)}")
    if jax.process_count() > 1:  # every process vouches for the same result
        log.info(f"process {jax.process_index()}: params_digest {summary['params_digest']}")
    return summary


@console.shown
def run(config: RunConfig, stop: StopOnSignal | None = None) -> dict:
    """Train as ``config`` says; say its progress (``jaxtrain.io.console``: logged, shown unless the caller routes the
    ``jaxtrain`` logger); write the run's files; return the summary. ``stop``: the command's signal handling;
    without it (the Python API, a notebook) a Ctrl-C during training checkpoints and stops, says where its
    checkpoint is, and raises KeyboardInterrupt."""
    if stop is not None:
        return _run(config, stop)
    with StopOnSignal().interrupts() as stop:
        try:
            return _run(config, stop)
        except Exit:
            raise KeyboardInterrupt("training stopped (the line above says what was saved)") from None


def _run(config: RunConfig, stop: StopOnSignal) -> dict:
    c, requeue_job = config, requeue.check(config)  # a run that could not requeue fails now, not after its warning

    def joined(devices):  # the signal handling joins the devices before the data is read
        stop.vote = StopVote(devices) if jax.process_count() > 1 else None
        if stop.vote and c.stall_timeout:
            stop.watch_stalls(c.stall_timeout, f"process {jax.process_index()} on {hosts.host_of(jax.process_index())}")
        stop.reinstall()
        if requeue_job and jax.process_index() == 0:  # warned before training starts: requeued all the same
            stop.at_start_up = functools.partial(requeue.at_start_up, requeue_job, say)

    run = build(config, on_devices=joined)
    try:
        return train(run, command_outputs(requeue_job), stop)
    finally:
        run.loaders["train"].close(), run.loaders["test"].close()  # their worker processes, if any


def train(run: Run, outputs: Sequence[Output] | None = None, stop: StopOnSignal | None = None) -> dict:
    """Train ``run`` (``build(config)``) from its start or its newest checkpoint, and return its summary. Each of
    ``outputs`` (``run_outputs.Output``) is called at its point of the run: None, the command line's
    (``command_outputs``: files, tracker, events, model, samples); ``[]``, nothing written. ``stop``: the
    command's signal handling (None: none here; ``run`` stops on Ctrl-C)."""
    outputs = command_outputs() if outputs is None else list(outputs)
    stop = stop or StopOnSignal()
    try:
        return _train(run, outputs, stop)
    except BaseException:
        if run.checkpointer is not None:  # a run that failed before its end: its lock released (the run's own
            with contextlib.suppress(Exception):  # error is the one said, not a save's that failed with it)
                run.checkpointer.close()
        raise


def _train(run: Run, outputs: list[Output], stop: StopOnSignal) -> dict:
    try:
        state, position = initial_state(run)
    except Finished as f:
        summary, state = f.args
        for output in outputs:
            output.found_finished(run, summary, state)
        return summary
    with contextlib.ExitStack() as closing:
        for output in outputs:  # each closed last, whatever happens (in reverse order), told the error if any
            closing.push(lambda kind, error, trace, output=output: output.close(error))
            output.start(run, state, position)
        out_dir = next((o.out_dir for o in outputs if getattr(o, "out_dir", None) is not None), None)
        pipeline = run.trainer.describe() if run.trainer.pipeline_layout else None
        say(describe(run.config, run.model, run.devices, run.mesh, run.layout, pipeline, run.data, out_dir))
        trained = fit_run(run, state, position, stop, outputs)
        summary = summarise(run, trained)
        for output in outputs:
            output.finish(run, summary, trained.state)
    return summary
