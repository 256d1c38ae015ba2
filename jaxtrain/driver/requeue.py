"""A SLURM job that requeues itself after a signal's checkpoint (``--requeue-on-signal``).

A time limit is the common case: ``#SBATCH --signal=B:USR1@120`` warns the job two minutes before it, the run
checkpoints and stops, and ``scontrol requeue`` puts the job back in the queue; it starts again with the same
job id (``SLURM_RESTART_COUNT`` one higher) and ``--resume`` goes on from the checkpoint. Only SIGUSR1, the
warning a job asks for, requeues: SIGTERM is the scheduler's own (``scancel``, a preemption, which SLURM
requeues itself where the partition says so). Everything that could keep the requeue from happening is checked
before training starts, so a run never ends silently instead.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess

from jaxtrain import settings
from jaxtrain.errors import ConfigError, named
from jaxtrain.driver.outputs import OutputError

log = logging.getLogger(__name__)


def check(config) -> dict | None:
    """The job to requeue (``settings.slurm_job``) where ``config.requeue_on_signal`` asks for it, else None;
    a ConfigError now if it could not be requeued later."""
    if not config.requeue_on_signal:
        return None
    job = settings.slurm_job()
    if job is None:
        raise ConfigError(f"{named('requeue_on_signal', True)} needs a SLURM job (SLURM_JOB_ID is not set): run it "
                          "with sbatch, or drop it")
    if not (config.checkpoint_dir and config.resume):
        raise ConfigError(f"{named('requeue_on_signal', True)} needs {named('checkpoint_dir')} and "
                          f"{named('resume', True)}, so the requeued job goes on from the signal's checkpoint")
    if shutil.which("scontrol") is None:
        raise ConfigError(f"{named('requeue_on_signal', True)} needs SLURM's scontrol on PATH (it is not): add "
                          "SLURM's bin directory to PATH, or drop it")
    return job


def command(job: dict) -> list[str]:
    """How the job is requeued: ``scontrol requeue JOB`` (an array's task: ``ARRAYJOB_TASK``)."""
    return ["scontrol", "requeue", job["requeue_id"]]


def requeue(job: dict, say) -> None:
    """``scontrol requeue`` the job (once, from process 0), saying what came of it. SLURM signals every
    process of the job at once: whatever must be written is written before."""
    done = subprocess.run(command(job), capture_output=True, text=True)
    if done.returncode:
        log.error(f"{' '.join(command(job))} failed: {(done.stderr or done.stdout).strip()}: requeue the job by "
                  "hand (its checkpoint is saved)")
    else:
        say(f"requeued the job: {' '.join(command(job))} (it goes on from the checkpoint when it starts again)")


REQUEUE_SIGNAL = "SIGUSR1"


def after_stop(job: dict | None, writer, step: int, signal_name: str, say, saved: bool) -> None:
    """Once a signal's checkpoint is closed: say in metrics.jsonl what is done (from process 0, the one with a
    ``writer``), then requeue ``job`` if asked, the signal was the warning and the checkpoint was saved."""
    if writer is None:
        return

    def row(requeued: str | None) -> None:
        try:
            writer.stopped(step, signal_name, saved, requeued)
        except OutputError as e:  # a full disk: said; the stop (and its requeue) goes on
            say(f"the stop's row in metrics.jsonl was not written: {e}")

    if not job:
        row(None)
    elif signal_name != REQUEUE_SIGNAL:
        say(f"not requeued: {signal_name} is the scheduler's ({named('requeue_on_signal', True)} requeues after "
            f"{REQUEUE_SIGNAL}, the warning before a time limit)")
        row(f"not requeued: {signal_name}")
    elif not saved:
        say("not requeued: the signal's checkpoint was not written (a requeued job would repeat the steps since "
            "the one before)")
        row("not requeued: no checkpoint")
    else:
        row(" ".join(command(job)))
        requeue(job, say)


def at_start_up(job: dict, say, signum: int) -> None:
    """The warning came before training started: requeue all the same (the checkpoint, if any, is intact)."""
    if signal.Signals(signum).name == REQUEUE_SIGNAL:
        requeue(job, say)
