"""Will my run fit on 8 H100s, and what will the GPUs execute? The train step compiled for real GPUs, here.

    pip install -e '.[gpu-compile]'      # once: JAX's CUDA plugin (Python >= 3.12), no GPU or driver needed
    python -m experiments.gpu_plan --model resnet18 --precision bf16 --gpu h100 --gpus 8

The step is the one ``python -m experiments.<model>`` trains with the same flags, compiled by XLA:GPU for
compile-only GPUs. It prints, per GPU: memory (params, optimizer state, batch, outputs, donation, temps) against
the GPU's memory, FITS or DOES NOT FIT; the largest batch that fits (found by compiling); FLOPs and bytes per step;
the collectives (kind, count, bytes, async, inside a loop); the kernels (cuDNN, cuBLAS, Triton, fusions); the
compile time. Nothing is autotuned and nothing runs: no figure is a GPU time. ``--json`` writes it all.
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain.cli import make_parser, one_line_errors, positive_int

def parser() -> argparse.ArgumentParser:
    from jaxtrain.gpu.plan import JAX_MEMORY_FRACTION, SETTINGS
    from jaxtrain.gpu.targets import names

    p = make_parser(prog="python -m experiments.gpu_plan", description=__doc__.split("\n")[0], fields=SETTINGS)
    g = p.add_argument_group("GPU target")
    g.add_argument("--gpu", choices=names(), default="h100", help="GPU model (vendors' published specifications)")
    g.add_argument("--gpus", type=positive_int, default=8, help="GPUs per host (an HGX/DGX node has 8)")
    g.add_argument("--hosts", type=positive_int, default=1, help="hosts (nodes)")
    g.add_argument("--memory-fraction", type=float, default=JAX_MEMORY_FRACTION,
                   help="share of a GPU's memory the run may use (JAX preallocates 75%% by default: "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION)")
    g.add_argument("--no-search", action="store_true", help="skip the search for the largest batch (a few compiles)")
    g.add_argument("--max-batch", type=positive_int, default=2**20, help="where the search for the largest batch stops")
    g.add_argument("--json", metavar="PATH", help="also write the plan as JSON here")
    return p


@one_line_errors("gpu_plan", flags={"gpus": "--gpus", "hosts": "--hosts", "memory_fraction": "--memory-fraction"})
def main(argv=None) -> int:
    args = vars(parser().parse_args(argv))
    from jaxtrain import gpu
    from jaxtrain.gpu.plan import SETTINGS, save

    gpu.check_plugin()  # before anything else starts: the plugin's one-line install hint
    settings = {k: v for k, v in args.items() if k in SETTINGS}
    result = gpu.plan(args["gpu"], args["gpus"], args["hosts"], largest_batch=not args["no_search"],
                      memory_fraction=args["memory_fraction"], max_batch=args["max_batch"],
                      progress=lambda text: print(text, file=sys.stderr, flush=True), **settings)
    print(result.format())
    if args["json"]:
        save(result, args["json"])
        print(f"\nwritten: {args['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

