"""``jaxtrain`` (the console command) and ``python -m jaxtrain``: train a model, or run one of the tools.

    jaxtrain lenet --devices 2       # the d2l LeNet on Fashion-MNIST (as python -m experiments.lenet)
    jaxtrain resnet18 | vit ...      # the other recipes; jaxtrain train --model NAME: any registered model
    jaxtrain sample RUN_DIR ...      # text from a finished GPT run (as python -m experiments.sample)
    jaxtrain export RUN_DIR FILE     # a finished run's model for PyTorch (as python -m experiments.export_weights)
    jaxtrain sweep ... | slurm ...   # python -m jaxtrain.sweep / jaxtrain.slurm
    jaxtrain gpu-plan ...            # python -m jaxtrain.gpu (experiments.gpu_plan)
    jaxtrain --version

Each command's own ``--help`` lists its flags. Nothing heavy is imported before the command is known: a
training command takes SIGINT / SIGTERM over before JAX starts (jaxtrain.cli.main).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxtrain.cli import RUNS  # light: JAX is imported inside a run's main()
from jaxtrain.version import __version__

RECIPES = tuple(model for model in RUNS.values() if model)  # the recipes an experiments/ module runs
TOOLS = {"train": "any registered model (--model NAME)",
         "sample": "text from a finished language-model run (jaxtrain sample RUN_DIR --prompt TEXT)",
         "export": "a finished run's model as a .safetensors file for PyTorch (jaxtrain export RUN_DIR FILE)",
         "sweep": "a hyperparameter sweep (optuna)",
         "slurm": "a SLURM job script for a run",
         "gpu-plan": "a run's memory, fit and step time on GPUs, compiled here (the gpu-compile extra)"}


def usage() -> str:
    rows = [f"  {name:<9} train {name} by its recipe (python -m experiments.{name})" for name in RECIPES]
    rows += [f"  {name:<9} {what}" for name, what in TOOLS.items()]
    return "\n".join(["usage: jaxtrain COMMAND [FLAGS ...]   (jaxtrain COMMAND --help: its flags)", "",
                      "commands:", *rows, "", "  --version print the version"])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "--version":
        print(f"jaxtrain {__version__}")
        return 0
    if name in RECIPES or name == "train":
        from jaxtrain.cli import main as run

        return run(name if name in RECIPES else None, rest, prog=f"jaxtrain {name}")
    if name in ("sample", "export"):
        from jaxtrain import cli

        return getattr(cli, name)(rest, prog=f"jaxtrain {name}")
    if name == "sweep":
        from jaxtrain.sweep.__main__ import run_command

        return run_command(rest, "jaxtrain sweep")
    if name == "slurm":
        from jaxtrain.slurm.__main__ import main as slurm

        return slurm(rest, prog="jaxtrain slurm")
    if name == "gpu-plan":
        from jaxtrain.gpu.__main__ import main as plan

        return plan(rest, prog="jaxtrain gpu-plan")
    print(f"jaxtrain: error: unknown command {name!r}: give one of {', '.join([*RECIPES, *TOOLS])} "
          "(jaxtrain --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
