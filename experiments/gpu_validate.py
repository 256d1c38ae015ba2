"""The step-time estimate held against published measurements: ResNet-50 v1.5 training on A100s and V100s.

    python -m experiments.gpu_validate              # 8 compiles of ResNet-50 (~5 minutes on 2 cores)
    python -m experiments.gpu_validate --gpu a100   # the A100 rows only

NVIDIA's DeepLearningExamples (PyTorch/Classification/ConvNets/resnet50v1.5/README.md, pytorch-21.03 container)
publishes training images/s on a DGX A100 (8x A100 80GB: TF32 and mixed precision, 256 images per GPU) and a
DGX-1 (8x V100 16GB: FP32 at 112 images per GPU, mixed precision at 256; configs.yml). The same network
(``jaxtrain.models.resnet50``: 224x224x3, 1000 classes, SGD with momentum) is compiled here for 1 and 8 GPUs:
fp32 (on A100, XLA runs f32 convolutions and matmuls as TF32), and for mixed precision bf16 on A100 (its bf16
and fp16 peaks are equal) and fp16 with loss scaling on V100 (no bf16 there); its step time is estimated
(``jaxtrain.gpu.estimate``).

The estimate has one fitted constant, the share of their rooflines kernels reach (``targets.json``
"_costs.efficiency"). It is fitted on ONE row, 1 A100 AMP; every other row is held out. This command prints the
fit it finds and says so if ``targets.json`` holds another value.
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain.cli import one_line_errors

# NVIDIA's published figures (the README named above): (gpu, GPUs, jaxtrain precision, images per GPU, name) -> img/s
PUBLISHED = {("a100", 1, "fp32", 256, "TF32"): 938, ("a100", 1, "bf16", 256, "AMP"): 2470,
             ("a100", 8, "fp32", 256, "TF32"): 7248, ("a100", 8, "bf16", 256, "AMP"): 16621,
             ("v100", 1, "fp32", 112, "FP32"): 367, ("v100", 1, "fp16", 256, "AMP"): 1200,
             ("v100", 8, "fp32", 112, "FP32"): 2855, ("v100", 8, "fp16", 256, "AMP"): 8322}
FIT_ON = ("a100", 1, "bf16", 256, "AMP")
SOURCE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md: DGX A100 "
          "(8x A100 80GB) and DGX-1 (8x V100 16GB)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_validate", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=sorted({k[0] for k in PUBLISHED}), action="append",
                   help="only these GPUs' rows (repeatable; default: all; the fit needs a100)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    return p


def fit_efficiency(roofline: float, launch: float, seconds: float) -> float:
    """The kernel efficiency that makes a program without communication take ``seconds``: its kernels'
    rooflines over the time they leave after the launches."""
    return roofline / (seconds - launch)


def rows(estimates: dict) -> list[dict]:
    """The table: one row per published cell with the estimate, the published figure and their ratio;
    ``estimates``: cell (a ``PUBLISHED`` key) -> ``Estimate.summary()``."""
    out = []
    for key, e in estimates.items():
        gpu, gpus, _, batch, name = key
        out.append({"gpu": gpu, "gpus": gpus, "precision": name, "batch_per_gpu": batch,
                    "estimate": e["examples_per_second"], "published": PUBLISHED[key],
                    "ratio": e["examples_per_second"] / PUBLISHED[key], "held_out": key != FIT_ON,
                    "bottleneck": e["bottleneck"], "exposed_share": e["exposed"] / e["seconds"]})
    return out


def format_rows(table: list[dict]) -> str:
    lines = ["| GPU | GPUs | precision | batch per GPU | estimate img/s | published img/s | ratio | row |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        waits = f"; {r['exposed_share']:.1%} of the step waits for collectives" if r["gpus"] > 1 else ""
        lines.append(f"| {r['gpu'].upper()} | {r['gpus']} | {r['precision']} | {r['batch_per_gpu']} | "
                     f"{r['estimate']:,.0f} | {r['published']:,} | {r['ratio']:.2f} | "
                     f"{'held out' if r['held_out'] else 'fitted'}; {r['bottleneck']}-bound{waits} |")
    return "\n".join(lines)


@one_line_errors("gpu_validate")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import json

    from jaxtrain import gpu
    from jaxtrain.gpu.targets import costs

    gpu.check_plugin()
    cells = [k for k in PUBLISHED if args.gpu is None or k[0] in args.gpu]
    estimates = {}
    for key in cells:
        name, gpus, precision, batch, label = key
        print(f"compiling ResNet-50 for {gpus} x {name.upper()}, {label}, {batch * gpus} images...",
              file=sys.stderr, flush=True)
        p = gpu.plan(name, gpus, 1, largest_batch=False, model="resnet50", precision=precision,
                     batch_size=batch * gpus, input_shape=(224, 224, 3), num_classes=1000)
        estimates[key] = p.estimate
    table = rows(estimates)
    print(f"ResNet-50 v1.5 training: the ESTIMATE against NVIDIA's measurements ({SOURCE})\n")
    print(format_rows(table))
    stored = costs().efficiency
    fitted = None
    if FIT_ON in estimates:
        e = estimates[FIT_ON]
        fitted = fit_efficiency(e["roofline"], e["launch"], FIT_ON[3] * FIT_ON[1] / PUBLISHED[FIT_ON])
        print(f"\nkernel efficiency (the one fitted constant): targets.json {stored:.3f}; this run's fit on 1 A100 "
              f"AMP: {fitted:.3f}{'' if abs(fitted - stored) < 0.005 else ' -- DIFFERENT: put the fit in targets.json'}")
    off = [r for r in table if not 1 / 1.5 <= r["ratio"] <= 1.5]
    print("every ratio within 1.5x" if not off else
          f"{len(off)} ratio(s) off by more than 1.5x: see docs/gpu-estimate.md 'How good is the estimate'")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "fitted_efficiency": fitted, "stored_efficiency": stored}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
