"""The README's "Memory on GPUs: remat or offload?" table: each remat policy's step compiled for one GPU here.

    python -m experiments.gpu_offload [--gpu h100] [--gpus 1] [--models resnet18,vit] [--precision bf16]

Per model and policy, from ``jaxtrain.gpu.plan`` (the step compiled by XLA:GPU on this host, no GPU used): the
device memory a step needs per GPU at the model's recipe batch, what it keeps in the host's pinned memory
(offloaded remat values), the bytes it moves to the host and back per step, the largest batch per GPU that fits
(found by compiling), and the step time ESTIMATED from the program (``jaxtrain.gpu.estimate``, the host link
timed at the target's PCIe figure: not a measurement). Needs the gpu-compile extra (README).
"""

from __future__ import annotations

import argparse
import sys

from experiments.bench_gpu_plans import print_plans
from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.gpu.report import size
from jaxtrain.gpu.targets import names

POLICIES = {  # what each model's blocks can save, recompute or offload (jaxtrain.core.remat)
    "lenet": ("none", "dots", "full", "offload_dots"),
    "resnet18": ("none", "dots", "full", "offload_dots"),
    "resnet50": ("none", "dots", "full", "offload_dots"),
    "vit": ("none", "dots_no_batch", "full", "offload_dots_no_batch", "offload_names:mlp_hidden,attention"),
}


def row(p) -> str:
    m, e = p.memory, p.estimate
    largest = "n/a" if p.largest_batch is None else (
        f"{'>= ' if p.largest_batch >= p.max_batch else ''}{p.largest_batch // (p.call_batch // p.per_gpu_batch):,}")
    moved = f"{size(e['to_host'])} / {size(e['from_host'])}" if e["to_host"] or e["from_host"] else "0"
    return (f"| {p.settings['model']} | {p.settings['remat']} | {size(m['total'])} | {size(m.get('host', 0))} | "
            f"{moved} | {largest} | {e['seconds'] * 1e3:,.2f} ms | {e['bottleneck']} |")


@one_line_errors("gpu_offload")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_offload", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=names(), default="h100")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs of one host")
    p.add_argument("--models", default="resnet18,vit", help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--no-search", action="store_true", help="skip the largest-batch search (one compile per row)")
    p.add_argument("--json", metavar="PATH", help="also write every plan as JSON here")
    args = p.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in POLICIES]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(POLICIES)}")
    from jaxtrain import gpu

    gpu.check_plugin()
    print(f"| model | remat | device memory per GPU | host memory per GPU | to host / back per step | "
          f"largest batch per GPU | step on {args.gpus} {args.gpu.upper()} (ESTIMATE) | bottleneck |\n"
          "|---|---|---|---|---|---|---|---|",
          flush=True)
    print_plans([{"gpu": args.gpu, "gpus": args.gpus, "model": model, "precision": args.precision, "remat": remat,
                  "largest_batch": not args.no_search} for model in models for remat in POLICIES[model]],
                row, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
