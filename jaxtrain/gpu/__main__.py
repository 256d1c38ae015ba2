"""Will my run fit on 8 H100s, and what will the GPUs execute? The train step compiled for real GPUs, here.

    pip install -e '.[gpu-compile]'      # once: JAX's CUDA plugin (Python >= 3.12), no GPU or driver needed
    jaxtrain gpu-plan --model resnet18 --precision bf16 --gpu h100 --gpus 8

The step is the one ``python -m experiments.<model>`` trains with the same flags, compiled by XLA:GPU for
compile-only GPUs. It prints, per GPU: memory (params, optimizer state, batch, outputs, donation, temps) against
the GPU's memory, FITS or DOES NOT FIT; the largest batch that fits (found by compiling); FLOPs and bytes per step;
the collectives (kind, count, bytes, async, inside a loop); the kernels (cuDNN, cuBLAS, Triton, fusions); the
compile time; and the step time ESTIMATED from the program (jaxtrain.gpu.estimate). ``--json`` writes it all.

    jaxtrain gpu-plan --model resnet50 --input-shape 224,224,3 --num-classes 1000 --precision bf16 \
        --gpu a100 --batch-size 256 --scaling 1,2,4,8,16,32,64 --plot scaling.png

``--scaling`` compiles the step for each GPU count (8 per host beyond 8) and prints the estimated throughput per
GPU, the scaling efficiency against the first count and the communication share; weak scaling keeps
``--batch-size`` per GPU, strong scaling keeps it global. Nothing is autotuned and nothing runs on a GPU.
``python -m jaxtrain.gpu`` and ``python -m experiments.gpu_plan`` are the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jaxtrain.cli import make_parser, one_line_errors, positive_int, whole_numbers
from jaxtrain.errors import ConfigError, need


PROG = "jaxtrain gpu-plan"


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    from jaxtrain.gpu.plan import JAX_MEMORY_FRACTION, SETTINGS
    from jaxtrain.gpu.scaling import MODES
    from jaxtrain.gpu.targets import names

    p = make_parser(prog=prog, description=__doc__.split("\n")[0], fields=SETTINGS)
    g = p.add_argument_group("GPU target")
    g.add_argument("--gpu", choices=names(), default="h100", help="GPU model (vendors' published specifications)")
    g.add_argument("--gpus", type=positive_int, default=8, help="GPUs per host (an HGX/DGX node has 8)")
    g.add_argument("--hosts", type=positive_int, default=1, help="hosts (nodes)")
    g.add_argument("--memory-fraction", type=_fraction, default=JAX_MEMORY_FRACTION,
                   help="share of a GPU's memory the run may use (JAX preallocates 75%% by default: "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION)")
    g.add_argument("--no-search", action="store_true", help="skip the search for the largest batch (a few compiles)")
    g.add_argument("--max-batch", type=positive_int, default=2**20, help="where the search for the largest batch stops")
    g.add_argument("--input-shape", type=_shape, metavar="H,W,C",
                   help="images of this shape instead of the dataset's (ResNet-50 on ImageNet: 224,224,3)")
    g.add_argument("--num-classes", type=positive_int, help="classes instead of the dataset's (ImageNet: 1000)")
    g.add_argument("--json", metavar="PATH", help="also write the plan (or the scaling rows) as JSON here")
    s = p.add_argument_group("scaling on paper (estimates)")
    s.add_argument("--scaling", type=whole_numbers(1, "1,2,4,8,16"), metavar="N,N,...",
                   help="compile for each GPU count (e.g. 1,2,4,8,16,32,64; 8 per host beyond 8) and print the "
                        "estimated scaling instead of one plan")
    s.add_argument("--scaling-mode", choices=MODES, default="weak",
                   help="weak: --batch-size per GPU; strong: --batch-size global")
    s.add_argument("--plot", metavar="PATH", help="with --scaling: draw it as a PNG here")
    return p


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], e.g. 0.75, got {text}")
    return value


def _shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected H,W,C (three positive integers, e.g. 224,224,3)")
    return shape


def _check(args: dict, settings: dict) -> None:
    """Every argument, before the plugin check: without the plugin a mistake is still said as itself."""
    from jaxtrain.driver.config import RunConfig

    RunConfig(devices=args["gpus"] * args["hosts"], **settings)  # each setting's own check (--batch-size 0, ...)
    if args["plot"] and not args["scaling"]:
        raise ConfigError("--plot draws a --scaling run: add --scaling 1,2,4,8")
    if args["plot"]:
        need("matplotlib.pyplot", "--plot")
    if args["json"]:
        path = Path(args["json"])
        folder = path.absolute().parent
        if path.is_dir():
            raise ConfigError(f"--json {path} is a directory: give the path of a file to write")
        why = "no such directory" if not folder.is_dir() else None if os.access(folder, os.W_OK) else "not writable"
        if why:
            raise ConfigError(f"--json {path}: cannot write in {folder} ({why}); give a path in a writable directory")


@one_line_errors(PROG, flags={"gpus": "--gpus", "hosts": "--hosts", "memory_fraction": "--memory-fraction"})
def main(argv=None, prog: str = PROG) -> int:
    args = vars(parser(prog).parse_args(argv))
    from jaxtrain.gpu.plan import SETTINGS, save

    settings = {k: v for k, v in args.items() if k in SETTINGS}
    _check(args, settings)
    from jaxtrain import gpu

    gpu.check_plugin()  # before anything starts compiling: the plugin's one-line install hint
    shape = {"input_shape": args["input_shape"], "num_classes": args["num_classes"]}

    def say(text):
        print(text, file=sys.stderr, flush=True)

    if args["scaling"]:
        return _scaling(args, settings, shape, say)
    result = gpu.plan(args["gpu"], args["gpus"], args["hosts"], largest_batch=not args["no_search"],
                      memory_fraction=args["memory_fraction"], max_batch=args["max_batch"],
                      progress=say, **shape, **settings)
    print(result.format())
    if args["json"]:
        save(result, args["json"])
        print(f"\nwritten: {args['json']}")
    return 0


def _scaling(args: dict, settings: dict, shape: dict, say) -> int:
    import json

    from jaxtrain.gpu.scaling import format_scaling, plot, scaling
    from jaxtrain.models import MODELS

    batch = settings.pop("batch_size") or MODELS[settings.get("model") or "lenet"].batch_size
    rows = scaling(args["gpu"], args["scaling"], args["scaling_mode"], batch_size=batch, progress=say,
                   memory_fraction=args["memory_fraction"], **shape, **settings)
    title = (f"{settings.get('model') or 'lenet'} on {args['gpu']}: {args['scaling_mode']} scaling, batch {batch:,}"
             f"{' per GPU' if args['scaling_mode'] == 'weak' else ' global'} (ESTIMATES, not measurements)")
    print(format_scaling(rows, title))
    if args["plot"]:
        plot(rows, args["plot"], title)
        print(f"\nplot: {args['plot']}")
    if args["json"]:
        with open(args["json"], "w") as f:
            json.dump(rows, f, indent=1)
        print(f"written: {args['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m jaxtrain.gpu"))

