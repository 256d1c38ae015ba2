"""One trial of a sweep as a subprocess: started, watched as it runs, stopped with its sweep, read at its end.

Each trial is a process of its own (its own device count and memory; a
crash ends the trial, not the sweep), in a session of its own: a signal
meant for the sweep (a terminal's Ctrl-C, a scheduler's SIGTERM to the
process group) reaches the sweep alone, which forwards it to each running
trial once. A trial also dies with its sweep (Linux: ``PR_SET_PDEATHSIG``).
Its per-epoch rows in ``metrics.jsonl`` are read as it runs: Optuna's
intermediate values, so a pruner can stop it.

How a trial's run ended, by its exit code: 0 and a ``summary.json``: its
objective; 3 (``errors.Diverged.EXIT_CODE``): training diverged, a normal
outcome of its settings (``TrialDiverged``); 2: a usage error, which every
trial would repeat (``ConfigError``: the sweep stops); anything else: the
trial failed (``TrialFailed``).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from jaxtrain import settings
from jaxtrain.errors import ConfigError, Diverged


class TrialFailed(Exception):
    """A trial's run ended without its summary (its log says why); the sweep goes on."""


class TrialDiverged(Exception):
    """A trial's run stopped because training diverged (its last log line says where); the sweep goes on."""


class Interrupted(Exception):
    """The sweep got a signal: the trial's run was sent it too and has stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _die_with_parent(cores):
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

    def setup():  # in the child, before exec: only system calls
        if libc is not None:
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the sweep killed -> SIGTERM (the run stops cleanly)
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def run(trial, argv: list[str], out_dir: Path, objective: str, slot: dict, prune: bool, env: dict | None = None,
        poll: float = 1.0, stop=None, beat=None) -> float:
    """Run one trial to its summary's ``objective``; per-epoch values reported to Optuna (pruned: SIGTERM the
    run, raise TrialPruned).

    Args:
        stop: the sweep's signals (``signum``, ``count``; see ``jaxtrain.sweep.command.Signals``): once set, the run is
            sent the signal, once per signal the sweep got, and Interrupted is raised when it has stopped.
        beat: called every ``poll`` seconds while the run runs (the sweep's heartbeat).
    """
    import optuna

    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**settings.environment(), **(env or {}), **slot.get("env", {})}
    with open(out_dir / "trial.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True,
                                preexec_fn=_die_with_parent(slot.get("cores")))  # noqa: PLW1509 - syscalls only
    trial.set_user_attr("out", str(out_dir))
    reported = set()
    try:
        while True:
            try:
                proc.wait(timeout=poll)
                done = True
            except subprocess.TimeoutExpired:
                done = False
            # Stopped by the sweep's signal (or by the same signal sent to it directly, as a scheduler sends it to
            # every process of a job, so it may end before the sweep forwards it): queued again, not failed.
            if stop is not None and stop.signum and not (done and proc.returncode == 0):
                _forward(proc, stop, poll)
                raise Interrupted(stop.signum)
            if beat is not None and not done:
                beat()
            for row in epoch_rows(out_dir / "metrics.jsonl"):
                value = row.get(objective)
                if row["epoch"] in reported or value is None or not math.isfinite(value):
                    continue
                reported.add(row["epoch"])
                trial.report(float(value), row["epoch"])
                if prune and not done and trial.should_prune():
                    proc.terminate()
                    proc.wait()
                    raise optuna.TrialPruned(f"epoch {row['epoch']}: {objective} {value:.4g}")
            if done:
                break
    finally:
        if proc.poll() is None:  # the sweep stops (an error): the run stops with it
            proc.terminate()
            proc.wait()
    return result(out_dir, objective, proc.returncode, argv)


def _forward(proc, stop, poll: float) -> None:
    """Send the run each signal the sweep gets (the first: stop cleanly; a second: at once), until it exits."""
    sent = 0
    while proc.poll() is None:
        if sent < stop.count:
            proc.send_signal(stop.signum)
            sent = stop.count
        try:
            proc.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            pass


def epoch_rows(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = [json.loads(line) for line in lines if line.strip()]  # written whole (atomic), so never half a line
    return [row for row in rows if "event" not in row]  # a stop on a signal is a row of its own


def result(out_dir: Path, objective: str, returncode: int, argv: list[str]) -> float:
    summary_path = out_dir / "summary.json"
    if returncode != 0 or not summary_path.is_file():
        tail = _last_line(out_dir / "trial.log")
        if returncode == Diverged.EXIT_CODE:
            raise TrialDiverged(tail.split(": error: ", 1)[-1])  # the run's one line, less its program's name
        if returncode == 2:  # a usage error: every trial would fail the same way
            raise ConfigError(f"the trial's command failed with a usage error: {tail} (command: {shlex.join(argv)})")
        raise TrialFailed(f"exit code {returncode}: {tail} (log: {out_dir / 'trial.log'})")
    summary = json.loads(summary_path.read_text())
    value = summary.get(objective)
    if not isinstance(value, (int, float)):
        numbers = sorted(k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        raise ConfigError(f"--objective {objective}: not a number in the run's summary.json; choose one of "
                          f"{', '.join(numbers)}")
    return float(value)


def track_failed(out_dir: Path) -> str | None:
    """Why the run's tracker stopped logging (``--track``: kept in ``OUT/track.json``), or None."""
    try:
        kept = json.loads((out_dir / "track.json").read_text())
    except (OSError, ValueError):
        return None
    failed = kept.get("failed") if isinstance(kept, dict) else None
    return failed if isinstance(failed, str) else None


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"
