"""``python -m jaxtrain.sweep`` (and ``jaxtrain sweep``): the sweep's command line over
``jaxtrain.sweep.command.sweep``."""

from __future__ import annotations

import argparse
import sys

from jaxtrain.errors import ConfigError


def run_command(argv, prog: str) -> int:
    """The sweep's command line as ``prog`` (``jaxtrain sweep``, ``python -m jaxtrain.sweep``): its extra missing
    is one line, exit 2 (``jaxtrain.sweep.command`` needs optuna to import)."""
    try:
        from jaxtrain.sweep import command  # noqa: F401 - needs optuna (and says so in one line)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.EXIT_CODE
    return main(argv, prog=prog)


def make_parser(prog: str = "python -m jaxtrain.sweep") -> argparse.ArgumentParser:
    from jaxtrain.sweep import trials as T

    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Hyperparameter sweep on Optuna: each trial a normal run (its own --out), the study in a "
                    "database; run it again to go on (nothing finished is re-run).",
        epilog="example:\n  python -m jaxtrain.sweep --study lenet-lr --storage sqlite:///runs/sweeps.db --trials 20 "
               "\\\n      --param lr=log:1e-3:1 --param batch_size=choice:128,256,512 \\\n"
               "      --param optimizer=choice:sgd,momentum,adamw -- jaxtrain lenet --epochs 3\n\n"
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
    p.add_argument("--seed", type=int, help="the sampler's seed: trial N's settings are drawn from (seed, N), so a "
                   "sweep continued in chunks or by several workers draws as one sweep would (default: the study's "
                   "own; a new study's is 0)")
    p.add_argument("--max-failures", type=int, default=3, help="stop the sweep when this many of its trials fail "
                   "one after another (a command that cannot start fails them all); 0: never (default 3)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the run's command")
    return p


def main(argv=None, prog: str = "python -m jaxtrain.sweep") -> int:
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.trials < 1 or args.parallel < 1:
        parser.error("--trials and --parallel take numbers >= 1")
    if args.max_failures < 0:
        parser.error("--max-failures takes a number >= 0 (0: never stop on failures)")
    from jaxtrain.cli import library_log
    from jaxtrain.sweep import study as S
    from jaxtrain.sweep.command import Interrupted, sweep

    try:
        with library_log():
            study = sweep(args.study, args.storage, args.param, args.trials, command=command, objective=args.objective,
                          direction=args.direction, prune=args.prune, parallel=args.parallel, out_dir=args.dir,
                          seed=args.seed, max_failures=args.max_failures)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.EXIT_CODE
    except Interrupted as e:
        stopped = (f"; trial(s) {', '.join(map(str, e.stopped))} stopped, marked failed, their settings queued "
                   "again" if e.stopped else "")
        print(f"{parser.prog}: {e} received: stopped{stopped}; run the same command to go on", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # before the sweep's own handling began
        print(f"{parser.prog}: interrupted; run the same command to go on", file=sys.stderr)
        return 130
    import optuna

    state = optuna.trial.TrialState
    finished = study.get_trials(deepcopy=False, states=(state.COMPLETE, state.PRUNED))
    running = S.running_elsewhere(study)
    if running and len(finished) < args.trials:  # another worker of the study (a job array's task) has the rest
        print(f"{parser.prog}: {running} trial(s) still running in other sweeps of study {args.study!r}: it "
              "finishes when they do", file=sys.stderr)
    return 0 if len(finished) + running >= args.trials else 1


if __name__ == "__main__":
    sys.exit(run_command(None, "python -m jaxtrain.sweep"))
