"""A sweep's workers: each takes trials of the study (``study.claim``) and runs them until the budget is met.

One worker per ``--parallel`` slot (threads of the sweep; one worker runs
in the calling thread). A trial ends complete, pruned (by the pruner, or
diverged: a normal outcome of its settings, which the sampler learns from),
or failed; the sweep goes on, until ``max_failures`` trials fail one after
another with the same error (a command that cannot start: OOMs of large
settings differ, and a trial that ends between failures starts the count
again). That, a usage error, a database error or a signal stops every
worker: the trials they were running are stopped (the signal is forwarded
once), marked failed and their settings queued again.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import optuna

from jaxtrain.errors import ConfigError
from jaxtrain.sweep import study as S, trial_run as R

STATE = optuna.trial.TrialState


class Signals:
    """``with Signals() as stop``: SIGINT / SIGTERM / SIGUSR1 (a SLURM job's warning) to the sweep are recorded
    (``signum``: the first; ``count``) for the running trials to forward, instead of killing the sweep (from the
    main thread only)."""

    def __init__(self):
        self.signum, self.count = 0, 0
        self._previous: dict = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        return self

    def _on(self, signum, _frame) -> None:
        self.signum = self.signum or signum
        self.count += 1

    def stop(self) -> None:
        """Stop every worker as a SIGTERM would (one worker's error stops the others)."""
        self._on(signal.SIGTERM, None)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclasses.dataclass
class Workers:
    """What the workers of one sweep share: the study and its storage, the trials' command and folder."""

    study: optuna.Study
    storage: object
    command: object  # trials.Command
    params: list
    folder: Path
    objective: str
    prune: bool
    env: dict
    trials: int  # the budget: finished (complete or pruned) trials to reach
    stop: Signals
    say: object
    max_failures: int = 3  # trials failed in a row (this sweep's) that stop it; 0: never
    stopped: list = dataclasses.field(default_factory=list)  # trials a signal stopped (failed, queued again)
    running: set = dataclasses.field(default_factory=set)  # trials whose end is not stored yet
    failed: list = dataclasses.field(default_factory=list)  # this sweep's last trials, failed alike, one after another
    _counting: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def run(self, slots: list[dict]) -> None:
        """Run the workers, one per slot, to the budget; the first error of any worker is raised."""
        if len(slots) == 1:
            return self.work(slots[0])
        errors = []

        def work(slot):
            try:
                self.work(slot)
            except BaseException as e:  # noqa: BLE001 - raised below, in the sweep's thread
                errors.append(e)
                self.stop.stop()

        threads = [threading.Thread(target=work, args=(slot,), name=f"sweep-worker-{i}") for i, slot in
                   enumerate(slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return None

    def work(self, slot: dict) -> None:
        """Take trials and run them, until the budget is met or the sweep is stopped."""
        while not self.stop.signum:
            if self.max_failures and len(self.failed) >= self.max_failures:
                t = self.failed[-1]
                raise ConfigError(f"the last {len(self.failed)} trials failed, one after another, with the same "
                                  f"error (trial {t.number}: {t.user_attrs.get('failed', 'failed')}): mend the "
                                  "command (or give --max-failures more), then run the same sweep again to go on")
            trial = S.claim(self.study, self.storage, self.trials)
            if trial is None:
                return
            self.run_one(trial, slot)

    def run_one(self, trial, slot: dict) -> None:
        """Run ``trial``; store how it ended and say it in one line."""
        self.running.add(trial.number)
        try:
            values = {p.name: p.suggest(trial) for p in self.params}
            trial.set_user_attr("host", socket.gethostname())
            trial.set_user_attr("pid", os.getpid())
            out = self.folder / f"trial-{trial.number:04d}"
            argv = self.command.trial_argv(values, out, self.study.study_name)
            start, state, value = time.time(), STATE.COMPLETE, None
            try:
                value = R.run(trial, argv, out, self.objective, slot, self.prune, self.env, stop=self.stop,
                              beat=self._heartbeat(trial.number))
            except optuna.TrialPruned:
                state = STATE.PRUNED
            except R.TrialDiverged as e:
                state = STATE.PRUNED
                trial.set_user_attr("diverged", str(e))
            except R.TrialFailed as e:
                state = STATE.FAIL
                trial.set_user_attr("failed", str(e))
            trial.set_user_attr("sec", round(time.time() - start, 1))
            if why := R.track_failed(out):
                trial.set_user_attr("track_failed", why)
            ended = self.study.tell(trial, value, state=state)
        except R.Interrupted:
            S.fail_and_queue_again(self.study, self.storage, trial.number)
            self.stopped.append(trial.number)
            self.running.discard(trial.number)
            return
        except BaseException:
            self._fail(trial)
            raise
        self.running.discard(trial.number)
        with self._counting:  # the workers' threads end trials at once
            alike = self.failed and _error(self.failed[-1]) == _error(ended)
            self.failed = [] if ended.state != STATE.FAIL else [*self.failed, ended] if alike else [ended]
        self.say(self.line(ended))

    def _fail(self, trial) -> None:
        """Mark ``trial`` failed if the database still lets us (a full disk may not)."""
        try:
            self.study.tell(trial, state=STATE.FAIL, skip_if_finished=True)
            self.running.discard(trial.number)
        except Exception:  # noqa: BLE001, S110 - the error that brought us here is the one to report
            pass

    def _heartbeat(self, number: int):
        """Optuna's heartbeat for a trial (a sweep on another host that goes quiet has its trials failed)."""
        interval = self.storage.get_heartbeat_interval()
        trial_id, last = S.trial_id(self.study, self.storage, number), [float("-inf")]

        def beat():
            if time.monotonic() - last[0] >= interval:
                self.storage.record_heartbeat(trial_id)
                last[0] = time.monotonic()

        beat()
        return beat

    def line(self, t) -> str:
        """``[n/trials] trial N (settings): how it ended in S s; best: ...``."""
        n = S.counts(self.study, ("COMPLETE", "PRUNED"))
        if t.state == STATE.FAIL:
            result = "failed" + (f": {t.user_attrs['failed']}" if "failed" in t.user_attrs else "")
        elif "diverged" in t.user_attrs:
            result = f"diverged, pruned: {t.user_attrs['diverged']}"
        elif t.state == STATE.PRUNED:
            result = f"pruned at epoch {max(t.intermediate_values, default=0)}"
        else:
            result = f"{self.objective} {t.value:.4g}"
        try:
            best = f"; best: trial {self.study.best_trial.number} ({self.study.best_value:.4g})"
        except ValueError:
            best = ""
        settings = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in t.params.items())
        tracked = (f"; warning: its tracker stopped logging ({t.user_attrs['track_failed']})"
                   if "track_failed" in t.user_attrs else "")
        return (f"[{n}/{self.trials}] trial {t.number} ({settings}): {result} in {t.user_attrs.get('sec', 0):.0f} s"
                f"{best}{tracked}")


def _error(trial) -> str:
    """A failed trial's error, less what is each trial's own: where its log is, its folder (``trial-0003``)."""
    return re.sub(r"trial-\d+", "trial-N", trial.user_attrs.get("failed", "").split(" (log: ")[0])
