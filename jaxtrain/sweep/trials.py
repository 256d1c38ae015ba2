"""A sweep's pieces: the ``--param`` specs and the trials' command (run by ``jaxtrain.sweep.trial_run``).

A trial is the sweep's command with the sampled flags and its own ``--out``.
When the command is a jaxtrain run, its flags are checked before any trial
starts, and so is ``--objective``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxtrain import cli, settings
from jaxtrain.errors import ConfigError
from jaxtrain.models import LANGUAGE_MODELS, MODELS
from jaxtrain.driver.config import RunConfig, flag
from jaxtrain.driver.sections import FIELDS as CONFIG_FIELDS, check_value

# The numbers in a jaxtrain run's summary.json (report.run_summary; tests/test_sweep.py keeps the two alike)
SUMMARY_NUMBERS = ("test_acc", "test_loss", "train_loss", "train_acc", "initial_loss", "sec_per_epoch",
                   "ms_per_update", "first_epoch_sec", "median_epoch_sec", "examples_per_sec", "data_wait_fraction",
                   "workers", "prefetch", "devices", "processes", "accum_steps", "compiled_flops", "ms_per_step",
                   "achieved_flops_per_sec", "peak_flops_per_sec", "mfu", "hfu", "model_flops_per_example",
                   "compiled_temp_bytes", "saved_residual_bytes", "steps", "epochs", "batch_size", "lr", "seed",
                   "train_examples", "test_examples")
# A language model's summary.json adds these numbers (driver.language.summary; tests/test_sweep_study.py, likewise)
LANGUAGE_NUMBERS = ("tokens_per_sec", "test_perplexity", "unigram_entropy", "seq_len", "vocab")
# Settings a sweep does not vary, and why
UNSWEPT = {"model": "a sweep trains one model (give it in the command; sweep another in a study of its own)",
           "out": "each trial writes to its own folder under the study's (--dir)",
           "checkpoint_dir": "trials would write over each other's checkpoints (a trial whose sweep stops is run "
                             "again from its start)",
           "resume": "a trial starts afresh (one whose sweep stopped is run again from its start)"}
KINDS = {"log": "log-uniform float LO:HI", "float": "uniform float LO:HI", "int": "whole number LO:HI",
         "choice": "one of A,B,C"}
FIELDS = {name: f for name, (_, f) in CONFIG_FIELDS.items()}


@dataclasses.dataclass(frozen=True)
class Param:
    """One swept setting: ``name=log:1e-4:1``, ``name=float:0:0.5``, ``name=int:1:8``, ``name=choice:a,b,c``."""

    name: str  # a RunConfig field
    kind: str
    values: tuple  # (lo, hi) or the choices

    def suggest(self, trial):
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, list(self.values))
        if self.kind == "int":
            return trial.suggest_int(self.name, *self.values)
        return trial.suggest_float(self.name, *self.values, log=self.kind == "log")

    def spec(self) -> str:
        return f"{self.name}={self.kind}:" + (",".join(map(str, self.values)) if self.kind == "choice"
                                                else ":".join(map(str, self.values)))


def parse_param(text: str) -> Param:
    """``--param`` text -> Param, each value checked as RunConfig checks it (ConfigError: one line)."""
    name, eq, rest = text.partition("=")
    kind, _, args = rest.partition(":")
    name = name.strip().lstrip("-").replace("-", "_")
    if not eq or kind not in KINDS or not args:
        raise ConfigError(f"--param {text!r}: write NAME=KIND:VALUES with KIND one of "
                          + "; ".join(f"{k} ({v})" for k, v in KINDS.items()) + ", e.g. lr=log:1e-4:1")
    if name in UNSWEPT:
        raise ConfigError(f"--param {text!r}: {flag(name)} is not swept: {UNSWEPT[name]}")
    if name not in FIELDS:
        near = difflib.get_close_matches(name, [n for n in FIELDS if n not in UNSWEPT], n=1)
        raise ConfigError(f"--param {text!r}: {name!r} is not a setting of a run"
                          + (f" (did you mean {near[0]}?)" if near else "") + "; see the command's --help")
    ftype = FIELDS[name].type
    if kind == "choice":
        values = tuple(_value(name, v.strip(), ftype, text) for v in args.split(","))
    else:
        parts = args.split(":")
        if len(parts) != 2:
            raise ConfigError(f"--param {text!r}: {kind} takes LO:HI, e.g. {name}={kind}:1:8")
        if not ftype.startswith(("int", "float")):
            raise ConfigError(f"--param {text!r}: {name} is not a number; use choice:A,B")
        if ftype.startswith("int") != (kind == "int"):
            raise ConfigError(f"--param {text!r}: " + (f"{name} is a whole number; use int:LO:HI" if kind != "int"
                              else f"{name} is a real number; use log:LO:HI or float:LO:HI"))
        values = tuple(_value(name, p.strip(), ftype, text) for p in parts)
        if not all(math.isfinite(v) for v in values):
            raise ConfigError(f"--param {text!r}: give finite bounds, e.g. {name}={kind}:1e-4:1")
        if not values[0] < values[1] or kind == "log" and values[0] <= 0:
            log = " and LO > 0 (log scale)" if kind == "log" else ""
            raise ConfigError(f"--param {text!r}: expected LO < HI{log}")
    for v in values:  # the setting's own checks (choices, minimum) on each value; with the command's other
        try:          # settings: Command.check_param
            check_value(name, v)
        except ConfigError as e:
            raise ConfigError(f"--param {text!r}: {e}") from None
    return Param(name, kind, values)


def _value(name: str, text: str, ftype: str, spec: str):
    try:
        if ftype == "bool":
            return {"true": True, "false": False}[text.lower()]
        if ftype.startswith("int"):
            return int(text)
        return float(text) if ftype.startswith("float") else text
    except (KeyError, ValueError):
        want = {"bool": "true or false", "int": "a whole number", "float": "a number"}[ftype.split()[0]]
        raise ConfigError(f"--param {spec!r}: {name} takes {want}, got {text!r}") from None


@dataclasses.dataclass
class Command:
    """The sweep's command (everything after ``--``). ``model``: the jaxtrain model it trains, when it is a
    jaxtrain run (``python -m experiments.MODEL`` or ``python -m jaxtrain.cli --model MODEL``); its flags are
    then checked, and tracking and the best command line are spelled by jaxtrain's CLI."""

    argv: tuple[str, ...]
    model: str | None = None
    module: str | None = None

    @classmethod
    def parse(cls, argv, swept=()) -> Command:
        if not argv:
            raise ConfigError("no command to sweep: end the sweep's flags with -- and the run, e.g. -- jaxtrain lenet "
                              "--epochs 3")
        argv = tuple(argv)
        if argv[0] in ("python", "python3"):  # the sweep's own interpreter (its venv), as the user meant
            argv = (sys.executable, *argv[1:])
        if argv[0] == "jaxtrain":  # the console command: the sweep's own (its venv's, on PATH or not)
            argv = _console_run(argv[1:])
        elif argv[0] == sys.executable and argv[1:3] == ("-m", "jaxtrain"):  # python -m jaxtrain: the same
            argv = _console_run(argv[3:])
        if shutil.which(argv[0]) is None:  # before any trial is made
            raise ConfigError(f"command not found: {argv[0]} (give a program on PATH or a path to an executable "
                              "file after --)")
        module = argv[2] if len(argv) > 2 and argv[1] == "-m" else None
        model = (module.removeprefix("experiments.") if module and module.removeprefix("experiments.") in MODELS
                 else "jaxtrain.cli" if module == "jaxtrain.cli" else None)
        command = cls(argv, model, module)
        if model is not None:
            config = command.config({})
            command.model = config.model
            for name in swept:
                if flag(name) in argv:
                    raise ConfigError(f"the command sets {flag(name)}, which --param sweeps: leave it out of the "
                                      "command")
            if config.out is not None:
                raise ConfigError("the command sets --out: leave it out; each trial gets its own under the study's "
                                  "folder (--dir)")
            if config.checkpoint_dir is not None:
                raise ConfigError("the command sets --checkpoint-dir, which every trial would share: leave it out "
                                  "(a trial whose sweep stops is run again from its start)")
        return command

    def check_param(self, param: Param, others: Sequence[Param] = ()) -> None:
        """Each of ``param``'s values with the command's own settings (a jaxtrain run's), as a trial would run it:
        ``--param alpha=...`` needs the command's ``--teacher``, ``repeats`` its 'stage' axis; or with a value of
        another swept setting (``image_size`` with a swept ``dataset=choice:folder:A,folder:B``). A ConfigError
        (one line, before any trial) for a value no trial could run."""
        if self.model is None:
            return
        tries = [{}, *({o.name: w} for o in others if o.name != param.name for w in o.values)]
        for v in param.values:
            errors = []
            for other in tries:
                try:
                    self.config({**other, param.name: v})
                    break
                except ConfigError as e:
                    errors.append(e)
            else:
                raise ConfigError(f"--param {param.spec()!r} with the command's settings: {errors[0]}")

    def check_objective(self, objective: str) -> None:
        """A jaxtrain run's ``objective`` must be a number of its summary.json (ConfigError: one line)."""
        numbers = SUMMARY_NUMBERS + (LANGUAGE_NUMBERS if self.model in LANGUAGE_MODELS else ())
        if self.model is not None and objective not in numbers:
            near = difflib.get_close_matches(objective, numbers, n=1)
            raise ConfigError(f"--objective {objective}: not a number in the run's summary.json"
                              + (f" (did you mean {near[0]}?)" if near else "")
                              + "; e.g. test_acc (maximize) or test_loss (--direction minimize)")

    def config(self, values: dict) -> RunConfig:
        """The RunConfig of a trial's flags (jaxtrain runs only), as the run parses them (``cli.run_config``);
        ConfigError on an unknown or bad flag."""
        return cli.run_config(self.argv, flags(values))

    def trial_argv(self, values: dict, out_dir: Path, group: str) -> list[str]:
        argv = [*self.argv, *flags(values), "--out", str(out_dir)]
        if self.model is not None:
            config = self.config(values)
            if config.track != "none" and config.track_group is None:
                argv += ["--track-group", group]  # the tracker groups a study's trials
        return argv

    def trial_env(self, folder: Path) -> dict:
        """A tracked study's trials log to one MLflow store, the study's (unless MLFLOW_TRACKING_URI is set)."""
        if self.model is None or self.config({}).track != "mlflow" or settings.tracker("MLFLOW_TRACKING_URI"):
            return {}
        return {"MLFLOW_TRACKING_URI": f"sqlite:///{(folder / 'mlflow.db').resolve()}"}

    def best_line(self, values: dict) -> str:
        """The command line of a trial's settings (jaxtrain runs: ``cli.to_argv``, defaults left out)."""
        if self.model is None:
            return shlex.join([*self.argv, *flags(values)])
        config = self.config(values)
        argv = cli.to_argv(config, model_fixed=self.module != "jaxtrain.cli")
        return shlex.join(["python", "-m", self.module, *argv])


def _console_run(args: Sequence[str]) -> tuple[str, ...]:
    """``jaxtrain RECIPE FLAGS`` / ``jaxtrain train FLAGS`` (the console command, or ``python -m jaxtrain``) as
    the run it is: ``python -m jaxtrain.cli [--model RECIPE] FLAGS`` in the sweep's interpreter."""
    recipes = [m for m in cli.RUNS.values() if m]
    name, flags = (args[0], list(args[1:])) if args else ("", [])
    if name not in (*recipes, "train"):
        raise ConfigError(f"the command jaxtrain {name}: not a training run; give jaxtrain RECIPE (one of "
                          f"{', '.join(recipes)}) or jaxtrain train --model NAME, then the run's flags")
    if name != "train" and any(f == "--model" or f.startswith("--model=") for f in flags):
        raise ConfigError(f"the command jaxtrain {name}: its recipe is the model; drop --model (or use jaxtrain "
                          "train --model NAME)")
    return (sys.executable, "-m", "jaxtrain.cli", *(["--model", name] if name != "train" else []), *flags)


def flags(values: dict) -> list[str]:
    argv = []
    for name, v in values.items():
        if isinstance(v, bool):
            argv += [flag(name)] if v else []  # a false switch: left out (the default)
        else:
            argv += [flag(name), str(v)]
    return argv
