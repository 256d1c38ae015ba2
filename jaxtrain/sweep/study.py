"""A sweep's Optuna study in its database: the storage, the study, its sampler, its trial budget, its orphans.

- The sampler draws trial N's settings from the study's seed and N alone
  (``SeededByTrial``): a sweep continued in chunks draws what one
  uninterrupted sweep would, and two workers on one study (their trial
  numbers differ) never draw the same settings.
- The budget is exact under any number of workers: a worker takes a trial
  only while fewer than ``--trials`` are finished or running, and one that
  loses the race for the last place puts its new trial back in the queue
  (WAITING, no settings) instead of running it (``claim``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import threading
from pathlib import Path

import numpy as np
import optuna

from jaxtrain.errors import ConfigError
from jaxtrain.io.dirlock import taking_turns

TAKEN = ("COMPLETE", "PRUNED", "RUNNING")  # the states that count against --trials


def storage_of(url: str):
    """Optuna's RDB storage for ``url``; a SQLite file's folder is made, and checked writable and undamaged
    (one-line errors)."""
    import sqlalchemy.exc

    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///")).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--storage {url}: cannot make {path.parent} ({e.strerror})") from None
        if path.is_dir():
            raise ConfigError(f"--storage {url}: {path} is a directory; give a file, e.g. "
                              f"sqlite:///{path / 'sweeps.db'}")
        if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
            raise ConfigError(f"--storage {url}: {path if path.exists() else path.parent} is not writable; "
                              "choose another file, e.g. sqlite:///runs/sweeps.db")
        check_sqlite(url, path)
    elif "://" not in url:
        raise ConfigError(f"--storage {url!r}: give a database URL, e.g. sqlite:///runs/sweeps.db")
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
    sqlite = Path(url.removeprefix("sqlite:///")).expanduser() if url.startswith("sqlite:///") else None
    try:  # sweeps started at once on a new database take turns to make its tables
        with taking_turns(sqlite) if sqlite else contextlib.nullcontext():
            # heartbeats: a trial whose sweep died on another host is failed after the grace period
            return optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=120,
                                              heartbeat_stale_trial_callback=retry)
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, ValueError) as e:
        raise ConfigError(f"--storage {url}: {str(e).splitlines()[0][:200]}") from None
    except OSError as e:  # its lock beside it cannot be made (a folder that takes no files: /proc)
        raise ConfigError(f"--storage {url}: cannot write beside {sqlite or 'it'} ({e.strerror or e}); choose "
                          "another file, e.g. sqlite:///runs/sweeps.db") from None


def check_sqlite(url: str, path: Path) -> None:
    """A SQLite file that exists must pass SQLite's ``quick_check``: a damaged one is one line saying what to do."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
            found = [row[0] for row in con.execute("PRAGMA quick_check(3)")]
        con.close()
    except sqlite3.DatabaseError as e:
        found = [str(e)]
    if found != ["ok"]:
        lines = [ln for row in found for ln in str(row).splitlines() if not ln.startswith("***")]
        raise damaged(url, f"SQLite's quick_check: {lines[0] if lines else found}")


def damaged(url: str, why: str) -> ConfigError:
    """The one-line error for a study database SQLite cannot read."""
    return ConfigError(f"--storage {url}: the database is damaged ({why[:160]}); restore it from a copy, or move it "
                       "away and run again to start the study afresh (the trials' runs stay in their folders)")


def storage_error(url: str, e: BaseException, running: list[int]) -> ConfigError:
    """A database error during the sweep (a full disk, a damaged file, a lost server) as one line; ``running``:
    the trials it left RUNNING (the next run of the sweep on this host marks them failed)."""
    cause = e if hasattr(e, "orig") else (e.__cause__ or e)  # Optuna's StorageInternalError wraps SQLAlchemy's
    cause = getattr(cause, "orig", None) or cause  # SQLAlchemy's wraps the driver's
    text = (str(cause).splitlines() or [type(cause).__name__])[0][:200]
    if "malformed" in text or "not a database" in text:
        return damaged(url, text)
    left = (f"; trial(s) {', '.join(map(str, running))} left RUNNING: the same command run again marks them failed "
            "and queues their settings again" if running else "")
    return ConfigError(f"--storage {url}: the study database failed ({text}){left}; free the space (or mend the "
                       "server) and run the same command again to go on")


class SeededByTrial(optuna.samplers.BaseSampler):
    """Optuna's TPE sampler, seeded for each trial with (``seed``, the trial's number) alone.

    Optuna's samplers keep one random stream per process, so every invocation restarts it: a sweep continued
    in chunks, or a second worker, would draw the same settings again. Here the stream belongs to the trial
    number, which the storage hands out once per study; what TPE learns from the finished trials is the same.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._samplers: dict[int, optuna.samplers.TPESampler] = {}
        self._lock = threading.Lock()

    def of(self, trial) -> optuna.samplers.TPESampler:
        """The TPE sampler of ``trial`` (made on first use, dropped when the trial ends)."""
        with self._lock:
            if trial.number not in self._samplers:
                seed = int(np.random.SeedSequence([self.seed, trial.number]).generate_state(1)[0])
                self._samplers[trial.number] = optuna.samplers.TPESampler(seed=seed)
            return self._samplers[trial.number]

    def infer_relative_search_space(self, study, trial):
        return self.of(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.of(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.of(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial):
        self.of(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values):
        self.of(trial).after_trial(study, trial, state, values)
        with self._lock:
            self._samplers.pop(trial.number, None)


def open_study(name: str, storage, direction: str, prune: bool, what: dict, seed: int | None):
    """The study, made or loaded, and its seed; a study started with another command, params, direction or seed
    is refused. ``what``: the command and params (JSON); ``seed``: None keeps the study's (new study: 0)."""
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if prune else optuna.pruners.NopPruner()
    study = optuna.create_study(study_name=name, storage=storage, direction=direction, load_if_exists=True,
                                pruner=pruner)
    what = {**what, "direction": direction}
    kept = {k: study.user_attrs.get(k) for k in what}
    if all(v is None for v in kept.values()):
        for k, v in what.items():
            study.set_user_attr(k, v)
    elif kept != what:
        differ = next(k for k in what if kept[k] != what[k])
        raise ConfigError(f"study {name!r} was started with another {differ} ({kept[differ]}, now {what[differ]}): "
                          "run it as it was started, or name a new --study")
    kept_seed = study.user_attrs.get("seed")
    if kept_seed is None:  # a new study (or one from before seeds were kept)
        kept_seed = 0 if seed is None else seed
        study.set_user_attr("seed", kept_seed)
    elif seed is not None and seed != kept_seed:
        raise ConfigError(f"study {name!r} was started with --seed {kept_seed}: leave --seed out (or give "
                          f"{kept_seed}) to go on, or name a new --study")
    study.sampler = SeededByTrial(kept_seed)
    return study


def counts(study, states=TAKEN) -> int:
    """The study's trials in ``states`` (names)."""
    wanted = tuple(optuna.trial.TrialState[s] for s in states)
    return len(study.get_trials(deepcopy=False, states=wanted))


def claim(study, storage, trials: int):
    """A trial for this worker, or None once ``trials`` are finished or running (the queue's first, else new).

    Two workers may both see one place left and both ask: the storage numbers their trials, and the one whose
    trial has ``trials`` taken trials before it puts it back in the queue (WAITING, no settings yet)."""
    optuna.storages.fail_stale_trials(study)  # a sweep on another host gone quiet: its trials are failed
    if counts(study) >= trials:
        return None
    trial = study.ask()
    taken = tuple(optuna.trial.TrialState[s] for s in TAKEN)
    before = sum(t.number < trial.number for t in study.get_trials(deepcopy=False, states=taken))
    if before >= trials:
        storage.set_trial_state_values(trial_id(study, storage, trial.number), optuna.trial.TrialState.WAITING)
        return None
    return trial


def trial_id(study, storage, number: int) -> int:
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


def fail_and_queue_again(study, storage, number: int) -> bool:
    """Trial ``number`` -> failed, and its settings queued once more (Optuna's heartbeat retry); False if it had
    already ended."""
    tid = trial_id(study, storage, number)
    try:
        if not storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    storage.get_heartbeat_stale_trial_callback()(study, storage.get_trial(tid))
    return True


def fail_orphans(study, storage) -> list[int]:
    """RUNNING trials of a dead sweep on this host (killed: they never ended) -> failed, their settings queued
    once more. Trials of live sweeps (``--parallel``, another terminal) are left alone."""
    host, orphans = socket.gethostname(), []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") != host or pid is None or _alive(pid):
            continue
        if fail_and_queue_again(study, storage, t.number):
            orphans.append(t.number)
    return orphans


def running_elsewhere(study) -> int:
    """RUNNING trials of other live sweeps of the study: on other hosts (their heartbeat vouches for them), or
    on this one with their sweep's process alive (a dead one's are the next sweep's orphans)."""
    host, count = socket.gethostname(), 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        count += t.user_attrs.get("host") != host or pid is not None and _alive(pid)
    return count


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
