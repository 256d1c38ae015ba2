"""Hyperparameter sweeps on Optuna, with a real study database: ``python -m jaxtrain.sweep``.

    python -m jaxtrain.sweep --study lenet-lr --storage sqlite:///runs/sweeps.db --trials 20 \\
        --param lr=log:1e-3:1 --param batch_size=choice:128,256,512 --param optimizer=choice:sgd,momentum,adamw \\
        -- python -m experiments.lenet --epochs 3

Each trial is a normal run (``jaxtrain.trials``) with its own ``--out`` in
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

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

from jaxtrain import trials as T
from jaxtrain.errors import ConfigError


def storage_of(url: str):
    """Optuna's RDB storage for ``url``; a SQLite file's folder is made, and checked writable (one-line errors)."""
    import optuna
    import sqlalchemy.exc

    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///")).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--storage {url}: cannot make {path.parent} ({e.strerror})") from None
        if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
            raise ConfigError(f"--storage {url}: {path if path.exists() else path.parent} is not writable; "
                              "choose another file, e.g. sqlite:///runs/sweeps.db")
    elif "://" not in url:
        raise ConfigError(f"--storage {url!r}: give a database URL, e.g. sqlite:///runs/sweeps.db")
    try:  # heartbeats: a trial whose sweep died on another host is failed after the grace period
        return optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=120,
                                          heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, ValueError) as e:
        raise ConfigError(f"--storage {url}: {str(e).splitlines()[0][:200]}") from None


def open_study(name: str, storage, direction: str, prune: bool, command: T.Command, params: list[T.Param], seed):
    """The study, made or loaded; a study started with another command, params or direction is refused."""
    import optuna

    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if prune else optuna.pruners.NopPruner()
    study = optuna.create_study(study_name=name, storage=storage, direction=direction, load_if_exists=True,
                                pruner=pruner, sampler=optuna.samplers.TPESampler(seed=seed))
    what = {"command": list(command.argv), "params": [p.spec() for p in params], "direction": direction}
    kept = {k: study.user_attrs.get(k) for k in what}
    if all(v is None for v in kept.values()):
        for k, v in what.items():
            study.set_user_attr(k, v)
    elif kept != what:
        differ = next(k for k in what if kept[k] != what[k])
        raise ConfigError(f"study {name!r} was started with another {differ} ({kept[differ]}, now {what[differ]}): "
                          "run it as it was started, or name a new --study")
    return study


def fail_orphans(study, storage) -> list[int]:
    """RUNNING trials of a dead sweep on this host (killed: they never ended) -> failed, their settings queued
    once more. Trials of live sweeps (``--parallel``, another terminal) are left alone."""
    import optuna

    host, orphans = socket.gethostname(), []
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") != host or pid is None or _alive(pid):
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        if storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL):  # its settings, queued again:
            storage.get_heartbeat_stale_trial_callback()(study, storage.get_trial(trial_id))
            orphans.append(t.number)
    return orphans


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def sweep(study: str, storage: str, params, trials: int = 20, *, command=None, base=None, objective: str = "test_acc",
          direction: str = "maximize", prune: bool = False, parallel: int = 1, out_dir: str | None = None,
          seed: int | None = 0, say=print):
    """Run ``study`` on to ``trials`` finished trials; the Optuna study. ``params``: ``--param`` specs (or
    trials.Param); the runs: ``command`` (argv) or ``base`` (a RunConfig, run as ``python -m jaxtrain.cli``)."""
    import optuna

    from jaxtrain import cli, sweep_report

    if (command is None) == (base is None):
        raise ConfigError("give the trials' command= (argv) or base= (a RunConfig), not both")
    if base is not None:
        command = [sys.executable, "-m", "jaxtrain.cli", *cli.to_argv(base, model_fixed=False)]
    model = base.model if base is not None else None
    params = [p if isinstance(p, T.Param) else T.parse_param(p, model or _model_of(command)) for p in params]
    if len({p.name for p in params}) != len(params) or not params:
        raise ConfigError("--param: give each swept setting once (at least one)")
    cmd = T.Command.parse(command, [p.name for p in params])
    folder = Path(out_dir) if out_dir else _default_dir(storage, study)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own line per trial says what Optuna would
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    rdb = storage_of(storage)
    s = open_study(study, rdb, direction, prune, cmd, params, seed)
    if orphans := fail_orphans(s, rdb):
        say(f"trial(s) {', '.join(map(str, orphans))}: their sweep was killed; marked failed, settings queued again")
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(s.get_trials(deepcopy=False, states=finished))
    say(f"study {study!r} in {storage}: {done} of {trials} trials finished; runs in {folder}")
    free, env = _slot_queue(slots(parallel)), cmd.trial_env(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def objective_fn(trial):
        values = {p.name: p.suggest(trial) for p in params}
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        slot, start = free.get(), time.time()
        try:
            out = folder / f"trial-{trial.number:04d}"
            return T.run(trial, cmd.trial_argv(values, out, study), out, objective, slot, prune, env)
        except T.TrialFailed as e:
            trial.set_user_attr("failed", str(e))
            raise
        finally:
            free.put(slot)
            trial.set_user_attr("sec", round(time.time() - start, 1))

    def progress(st, t):
        n = len(st.get_trials(deepcopy=False, states=finished))
        if t.state.name == "FAIL":
            result = "failed" + (f": {t.user_attrs['failed']}" if "failed" in t.user_attrs else "")
        elif t.state.name == "PRUNED":
            result = f"pruned at epoch {max(t.intermediate_values, default=0)}"
        else:
            result = f"{objective} {t.value:.4g}"
        try:
            best = f"; best: trial {st.best_trial.number} ({st.best_value:.4g})"
        except ValueError:
            best = ""
        settings = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in t.params.items())
        say(f"[{n}/{trials}] trial {t.number} ({settings}): {result} in {t.user_attrs.get('sec', 0):.0f} s{best}",
            flush=True)

    remaining = trials - done
    if remaining > 0:
        s.optimize(objective_fn, n_trials=remaining, n_jobs=parallel, catch=(T.TrialFailed,),
                   callbacks=[optuna.study.MaxTrialsCallback(trials, states=finished), progress])
    sweep_report.report(s, cmd, objective, folder, say)
    return s


def _slot_queue(items):
    import queue

    q = queue.Queue()
    for item in items:
        q.put(item)
    return q


def _model_of(command) -> str:
    module = command[2] if len(command) > 2 and command[1] == "-m" else ""
    return module.removeprefix("experiments.") if module.startswith("experiments.") else "lenet"


def _default_dir(storage: str, study: str) -> Path:
    if storage.startswith("sqlite:///"):
        return Path(storage.removeprefix("sqlite:///")).expanduser().parent / study
    return Path("runs") / "sweeps" / study


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxtrain.sweep", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Hyperparameter sweep on Optuna: each trial a normal run (its own --out), the study in a "
                    "database; run it again to go on (nothing finished is re-run).",
        epilog="example:\n  python -m jaxtrain.sweep --study lenet-lr --storage sqlite:///runs/sweeps.db --trials 20 "
               "\\\n      --param lr=log:1e-3:1 --param batch_size=choice:128,256,512 \\\n"
               "      --param optimizer=choice:sgd,momentum,adamw -- python -m experiments.lenet --epochs 3\n\n"
               "--param NAME=KIND:VALUES, NAME a run's setting (lr, batch_size, ...), KIND one of:\n"
               + "".join(f"  {k:7s} {v}\n" for k, v in T.KINDS.items())
               + "\nTracking: add --track wandb|mlflow to the command; each trial is logged, grouped by study.")
    p.add_argument("--study", required=True, help="the study's name (in the storage)")
    p.add_argument("--storage", default="sqlite:///runs/sweeps.db", help="Optuna storage URL (default: %(default)s)")
    p.add_argument("--trials", type=int, default=20, help="finished trials to reach (complete or pruned; default 20)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=KIND:VALUES", help="a swept setting (repeat)")
    p.add_argument("--objective", default="test_acc", help="summary.json number to optimise (default: test_acc)")
    p.add_argument("--direction", choices=("maximize", "minimize"), default="maximize")
    p.add_argument("--prune", action="store_true", help="stop hopeless trials early (median of the trials so far, "
                                                        "per epoch of the objective)")
    p.add_argument("--parallel", type=int, default=1, help="trials at once, each on its share of the GPUs (or CPU "
                   "cores); on a CPU-only box 1 is right: one run already uses every core (default 1)")
    p.add_argument("--dir", help="the study's folder of trial runs (default: next to a SQLite storage: DIR/STUDY)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the run's command")
    return p


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.trials < 1 or args.parallel < 1:
        parser.error("--trials and --parallel take numbers >= 1")
    try:
        study = sweep(args.study, args.storage, args.param, args.trials, command=command, objective=args.objective,
                      direction=args.direction, prune=args.prune, parallel=args.parallel, out_dir=args.dir,
                      seed=args.seed)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; run the same command to go on", file=sys.stderr)
        return 130
    import optuna

    finished = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                         optuna.trial.TrialState.PRUNED))
    return 0 if len(finished) >= args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
