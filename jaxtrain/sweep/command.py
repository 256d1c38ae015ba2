"""Hyperparameter sweeps on Optuna, with a real study database (the command: ``python -m jaxtrain.sweep``).

    python -m jaxtrain.sweep --study lenet-lr --storage sqlite:///runs/sweeps.db --trials 20 \\
        --param lr=log:1e-3:1 --param batch_size=choice:128,256,512 --param optimizer=choice:sgd,momentum,adamw \\
        -- jaxtrain lenet --epochs 3                   # or: -- python -m experiments.lenet --epochs 3

Each trial is a normal run (``jaxtrain.sweep.trials``) with its own ``--out`` in
the study's folder (``--dir``, default: next to the SQLite file,
``runs/sweeps/lenet-lr/trial-0007``); its ``summary.json`` gives the objective
(``--objective test_acc``, maximised). Per-epoch values go to Optuna as it
runs, so ``--prune`` (Optuna's median pruner) stops hopeless trials early.

The study is the record: run the same command again and it goes on to
``--trials`` finished trials (complete or pruned) and re-runs nothing
finished. A trial whose sweep was killed is marked failed, and its settings
are tried once more. From Python: ``sweep(study, storage, params, base=RunConfig(...))``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from jaxtrain import settings
from jaxtrain.errors import ConfigError, need
from jaxtrain.io import console

need("optuna", "jaxtrain sweep")  # before the modules that import it: one line, not a traceback
need("matplotlib.pyplot", "jaxtrain sweep's report")  # in the same extra: only a hand-made install lacks it
from jaxtrain.sweep import study as S, trial_run as R, trials as T  # noqa: E402
from jaxtrain.sweep.workers import Signals, Workers  # noqa: E402

log = logging.getLogger(__name__)


def slots(parallel: int) -> list[dict]:
    """Each of ``parallel`` trials at once gets its share: GPUs (CUDA_VISIBLE_DEVICES), else CPU cores."""
    if parallel == 1:
        return [{}]
    gpus = _gpu_count()
    units = list(range(gpus)) if gpus else sorted(os.sched_getaffinity(0))
    if parallel > len(units):
        raise ConfigError(f"--parallel {parallel}: only {len(units)} {'GPUs' if gpus else 'CPU cores'} to share")
    shares = [units[i::parallel] for i in range(parallel)]
    if gpus:
        return [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, s))}} for s in shares]
    return [{"cores": set(s)} for s in shares]


def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return sum(line.startswith("GPU ") for line in listed.splitlines())


@console.shown
def sweep(study: str, storage: str, params, trials: int = 20, *, command=None, base=None, objective: str = "test_acc",
          direction: str = "maximize", prune: bool = False, parallel: int = 1, out_dir: str | None = None,
          seed: int | None = None, max_failures: int = 3, say=None):
    """Run ``study`` on to ``trials`` finished trials; the Optuna study. ``params``: ``--param`` specs (or
    trials.Param); the runs: ``command`` (argv) or ``base`` (a RunConfig, run as ``python -m jaxtrain.cli``);
    ``seed``: the sampler's (None: the study's own; a new study's is 0); ``max_failures`` trials failed one after
    another with the same error stop the sweep with a ConfigError (0: never; a command that cannot start failed
    every trial, forever). A signal (SIGINT, SIGTERM) stops the running trials and raises
    ``trial_run.Interrupted``. Its lines (a trial each, the report) are logged
    (``jaxtrain.io.console``: shown unless the caller routes the ``jaxtrain`` logger), or given to ``say``."""
    import optuna
    import sqlalchemy.exc

    from jaxtrain import cli
    from jaxtrain.sweep import report as sweep_report

    say = say or log.info
    if (command is None) == (base is None):
        raise ConfigError("give the trials' command= (argv) or base= (a RunConfig), not both")
    if not study.strip() or study.strip(".") == "" or any(c in study for c in "/\\"):  # its folder's name too
        raise ConfigError(f"--study {study!r}: give a name, without / (it names the study's folder of trials), "
                          "e.g. --study lenet-lr")
    if not (isinstance(max_failures, int) and not isinstance(max_failures, bool) and max_failures >= 0):
        raise ConfigError(f"max_failures={max_failures!r}: expected a whole number >= 0 (0: never stop on failures)")
    if base is not None:
        command = [sys.executable, "-m", "jaxtrain.cli", *cli.to_argv(base, model_fixed=False)]
    params = [p if isinstance(p, T.Param) else T.parse_param(p) for p in params]
    if len({p.name for p in params}) != len(params) or not params:
        raise ConfigError("--param: give each swept setting once (at least one)")
    cmd = T.Command.parse(command, [p.name for p in params])
    for param in params:
        cmd.check_param(param, params)
    cmd.check_objective(objective)
    folder = Path(out_dir) if out_dir else _default_dir(storage, study)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own line per trial says what Optuna would
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # ask/tell with a heartbeat: Optuna warns; the workers record the heartbeat themselves (sweep_workers)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    rdb = S.storage_of(storage)
    writable(folder, "--dir" if out_dir else f"the study's folder {folder} (--dir)")
    workers = None
    try:
        with Signals() as stop:
            s = S.open_study(study, rdb, direction, prune, {"command": list(cmd.argv),
                                                             "params": [p.spec() for p in params]}, seed)
            if orphans := S.fail_orphans(s, rdb):
                say(f"trial(s) {', '.join(map(str, orphans))}: their sweep was killed; marked failed, settings "
                    "queued again")
            done = S.counts(s, ("COMPLETE", "PRUNED"))
            say(f"study {study!r} in {storage}: {done} of {trials} trials finished; runs in {folder}")
            env = cmd.trial_env(folder)
            _prepare_tracking(cmd, env, study)
            workers = Workers(s, rdb, cmd, params, folder, objective, prune, env, trials, stop, say, max_failures)
            workers.run(slots(parallel))
        if stop.signum:
            raise Interrupted(stop.signum, workers.stopped)
        sweep_report.report(s, cmd, objective, folder, say)
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        raise S.storage_error(storage, e, sorted(workers.running) if workers else []) from None
    return s


class Interrupted(R.Interrupted):
    """A signal stopped the sweep; ``stopped``: the trials it stopped (failed, their settings queued again)."""

    def __init__(self, signum: int, stopped: list[int]):
        super().__init__(signum)
        self.stopped = stopped


def writable(folder: Path, what: str) -> None:
    """``folder`` made if need be, and a file written in it, before any trial (ConfigError: one line)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: cannot write in {folder} ({e.strerror}); choose another --dir") from None


def _prepare_tracking(cmd, env: dict, study: str) -> None:
    """A tracked study's MLflow store and experiment, made once before the trials (parallel trials raced)."""
    if cmd.model is None or cmd.config({}).track != "mlflow":
        return
    from jaxtrain.driver import track

    uri = env.get("MLFLOW_TRACKING_URI") or settings.tracker("MLFLOW_TRACKING_URI")
    try:
        track.mlflow_experiment(uri, cmd.config({}).track_group or study)
    except Exception as e:  # noqa: BLE001 - a view: the trials go on, each saying so in its log
        log.warning(f"--track mlflow: cannot prepare {uri} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                    "each trial will try on its own")


def _default_dir(storage: str, study: str) -> Path:
    if storage.startswith("sqlite:///"):
        return Path(storage.removeprefix("sqlite:///")).expanduser().parent / study
    return Path("runs") / "sweeps" / study
