"""What the host launches of a run's step on a GPU, per JAXTRAIN_COMMAND_BUFFERS mode: compiled here, no GPU.

    pip install -e '.[gpu-compile]'      # JAX's CUDA plugin (Python >= 3.12); no GPU or driver needed
    python -m experiments.command_buffers --model lenet --steps-per-call 8

The step a run with these flags trains (``jaxtrain gpu-plan``'s), K steps a call, compiled by XLA:GPU for one GPU
of ``--gpu``'s kind under each mode (xla: XLA's own choice; off: no command buffers; loops: XLA's own plus loops
and conditionals; ``jaxtrain.core.compat.COMMAND_BUFFER_FLAGS``), each in a child process. Per mode: the
command buffers (CUDA graphs) and the thunks they hold, what the host launches for one call (a loop's body once a
trip, its condition never where the trip count is known: ``jaxtrain.gpu.thunks``), and for a K-step call, whether
a command buffer holds its loop over the steps and what the host launches each trip of it; then the command-buffer
types XLA took. Which mode is faster is a GPU's to measure: ``make gpu-check``'s buffers part.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments import harness
from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.command_buffers", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="lenet", help="a model of jaxtrain.models (lenet, resnet18, vit, gpt, ...)")
    p.add_argument("--steps-per-call", type=positive_int, default=8, help="K: steps in one compiled call")
    p.add_argument("--batch-size", type=positive_int, default=None, help="the per-GPU batch (None: the recipe's)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--model-size", default=None, help="a language model's size (gpt: tiny, 124m, ...)")
    p.add_argument("--gpu", default="h100", help="the GPU kind compiled for (jaxtrain.gpu.names())")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    return p


def table(result: dict) -> str:
    k, modes = result["steps_per_call"], result["modes"]
    loops = ("a loop of unknown trip count once, its condition too" if any(s["loops_of_unknown_trips"]
                                                                          for s in modes.values())
             else "its condition never: every trip count is known")
    lines = [f"{result['model']} ({result['precision']}), {k} step(s) a call, compiled for one {result['gpu']}: "
             f"what the host launches (a loop's body once a trip, {loops})",
             f"{'mode':>6} {'command buffers':>15} {'thunks in them':>14} {'launches a call':>15} "
             f"{'steps loop held':>15} {'launches a trip':>15}"]
    for mode, s in modes.items():
        held = "-" if s["steps_loop_captured"] is None else "yes" if s["steps_loop_captured"] else "no"
        trip = "-" if s["steps_loop_trip"] is None else s["steps_loop_trip"]
        lines.append(f"{mode:>6} {s['command_buffers']:>15} {s['captured']:>14} {s['host_launches']:>15} "
                     f"{held:>15} {trip:>15}")
    lines.append("types XLA took, as its dump lists those that differ from its defaults: " + "; ".join(
        f"{m}: {', '.join(s['types']) if s['types'] else 'none listed'}" for m, s in modes.items()))
    return "\n".join(lines)


@one_line_errors("command_buffers")
def main(argv=None) -> int:
    from jaxtrain.gpu import check_plugin, thunks

    args = parser().parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():  # before minutes of compiling
        raise ConfigError(f"--json {args.json}: its folder does not exist")
    check_plugin()
    settings = {"model": args.model, "precision": args.precision,
                **({"batch_size": args.batch_size} if args.batch_size else {}),
                **({"model_size": args.model_size} if args.model_size else {})}
    result = {"model": args.model, "precision": args.precision, "gpu": args.gpu,
              "steps_per_call": args.steps_per_call, "batch_size": args.batch_size,
              "modes": thunks.command_buffers(settings, args.steps_per_call, gpu=args.gpu)}
    print(table(result))
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
