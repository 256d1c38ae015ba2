"""The README's "Planning for GPUs" table: each model's step planned for 1 and 8 GPUs, compiled on this host.

    python -m experiments.bench_gpu_plans [--gpu h100] [--models lenet,resnet18,vit] [--gpus 1,8] [--precision bf16]

Each row is ``jaxtrain.gpu.plan`` (what ``python -m experiments.gpu_plan`` prints) at the model's recipe batch:
memory per GPU, the largest batch that fits, FLOPs per GPU per step, the collectives, the step time ESTIMATED
from the program (``jaxtrain.gpu.estimate``: not a measurement), the compile time.
Needs the gpu-compile extra (README).
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxtrain.cli import one_line_errors, whole_numbers
from jaxtrain.gpu.report import size
from jaxtrain.gpu.targets import names


def _collectives(entries: list) -> str:
    kinds: dict = {}
    for c in entries:
        count, nbytes = kinds.get(c["kind"], (0, 0))
        kinds[c["kind"]] = (count + c["count"], nbytes + c["bytes"])
    return "; ".join(f"{n} {kind} ({size(nbytes)})" for kind, (n, nbytes) in sorted(kinds.items())) or "none"


def row(p) -> str:
    shards = p.call_batch // p.per_gpu_batch
    largest = "n/a" if p.largest_batch is None else (
        f"{'>= ' if p.largest_batch >= p.max_batch else ''}{p.largest_batch:,} ({p.largest_batch // shards:,})")
    return (f"| {p.settings['model']} | {p.gpus * p.hosts} | {p.call_batch:,} | {size(p.memory['total'])} | {largest} "
            f"| {p.flops / 1e9:,.2f} | {_collectives(p.collectives)} | {p.estimate['seconds'] * 1e3:,.2f} ms "
            f"({p.estimate['examples_per_second']:,.0f}/s) | {p.compile_seconds:.1f} s |")


def print_plans(cells, row, json_path: str | None = None) -> list:
    """``jaxtrain.gpu.plan(**cell)`` for each cell, its ``row(plan)`` printed as it comes (progress on stderr);
    every plan as JSON to ``json_path``."""
    from jaxtrain import gpu

    plans = []
    for cell in cells:
        plans.append(gpu.plan(**cell, progress=lambda text: print(text, file=sys.stderr, flush=True)))
        print(row(plans[-1]), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([plan.to_json() for plan in plans], f, indent=1)
    return plans


@one_line_errors("bench_gpu_plans")
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_gpu_plans", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=names(), default="h100")
    p.add_argument("--models", default="lenet,resnet18,vit", help="comma-separated models")
    p.add_argument("--gpus", type=whole_numbers(1, "1,8"), default="1,8",
                   help="comma-separated GPU counts (one host each)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--json", metavar="PATH", help="also write every plan as JSON here")
    args = p.parse_args(argv)
    from jaxtrain import gpu

    gpu.check_plugin()
    print(f"| model | {args.gpu.upper()}s | batch | memory per GPU | largest batch (per GPU) | GFLOP per GPU per step "
          "| collectives per GPU | step (ESTIMATE: examples/s) | compile |\n|---|---|---|---|---|---|---|---|---|",
          flush=True)
    print_plans([{"gpu": args.gpu, "gpus": n, "model": model, "precision": args.precision}
                 for model in args.models.split(",") for n in args.gpus], row, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
