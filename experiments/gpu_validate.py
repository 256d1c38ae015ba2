"""The step-time estimate held against published measurements: ResNet-50 v1.5 training on A100s.

    python -m experiments.gpu_validate        # ~4 compiles of ResNet-50 (a few minutes on 2 cores)

NVIDIA's DeepLearningExamples (PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training performance:
NVIDIA DGX A100 (8x A100 80GB)", pytorch-21.03 container) publishes images/s for TF32 and mixed precision (AMP)
at 256 images per GPU (configs.yml, platform DGXA100). The same network (``jaxtrain.models.resnet50``: 224x224x3,
1000 classes, SGD with momentum) is compiled here for 1 and 8 A100s in fp32 (XLA: TF32 matmuls and convolutions)
and bf16 (A100's bf16 and fp16 peaks are equal), and its step time estimated (``jaxtrain.gpu.estimate``).

The estimate has one fitted constant, the share of their rooflines kernels reach (``targets.json``
"_costs.efficiency"). It is fitted on ONE row, 1 GPU AMP; the other three cells are held out. This command
prints the fit it finds and says so if ``targets.json`` holds another value.
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain.cli import one_line_errors

# (GPUs, precision) -> images/s: NVIDIA's published figures (the README named above).
PUBLISHED = {(1, "fp32"): 938, (1, "bf16"): 2470, (8, "fp32"): 7248, (8, "bf16"): 16621}
FIT_ON = (1, "bf16")
PER_GPU_BATCH = 256
SOURCE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md: DGX A100 "
          "(8x A100 80GB), 256 images per GPU")
NAMES = {"fp32": "TF32", "bf16": "AMP"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_validate", description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    return p


def fit_efficiency(roofline: float, launch: float, seconds: float) -> float:
    """The kernel efficiency that makes a program without communication take ``seconds``: its kernels'
    rooflines over the time they leave after the launches."""
    return roofline / (seconds - launch)


def rows(estimates: dict) -> list[dict]:
    """The table: one row per (GPUs, precision) with the estimate, the published figure and their ratio;
    ``estimates``: (GPUs, precision) -> ``Estimate.summary()``."""
    out = []
    for key, published in PUBLISHED.items():
        e = estimates[key]
        out.append({"gpus": key[0], "precision": NAMES[key[1]], "estimate": e["examples_per_second"],
                    "published": published, "ratio": e["examples_per_second"] / published,
                    "held_out": key != FIT_ON, "bottleneck": e["bottleneck"],
                    "exposed_share": e["exposed"] / e["seconds"]})
    return out


def format_rows(table: list[dict]) -> str:
    lines = [f"{'GPUs':>4}  {'precision':<9} {'estimate img/s':>14} {'published':>10} {'ratio':>6}  row"]
    for r in table:
        waits = f", {r['exposed_share']:.1%} of the step waits for collectives" if r["gpus"] > 1 else ""
        lines.append(f"{r['gpus']:>4}  {r['precision']:<9} {r['estimate']:>14,.0f} {r['published']:>10,} "
                     f"{r['ratio']:>6.2f}  {'held out' if r['held_out'] else 'fitted'}; {r['bottleneck']}-bound{waits}")
    return "\n".join(lines)


@one_line_errors("gpu_validate")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import json

    from jaxtrain import gpu
    from jaxtrain.gpu.targets import costs

    gpu.check_plugin()
    estimates = {}
    for gpus, precision in PUBLISHED:
        print(f"compiling ResNet-50 for {gpus} x A100, {NAMES[precision]}, {PER_GPU_BATCH * gpus} images...",
              file=sys.stderr, flush=True)
        p = gpu.plan("a100", gpus, 1, largest_batch=False, model="resnet50", precision=precision,
                     batch_size=PER_GPU_BATCH * gpus, input_shape=(224, 224, 3), num_classes=1000)
        estimates[gpus, precision] = p.estimate
    e = estimates[FIT_ON]
    fitted = fit_efficiency(e["roofline"], e["launch"], PER_GPU_BATCH * FIT_ON[0] / PUBLISHED[FIT_ON])
    table = rows(estimates)
    print(f"ResNet-50 v1.5 training on A100 80GB: the ESTIMATE against NVIDIA's measurements ({SOURCE})")
    print(format_rows(table))
    stored = costs().efficiency
    print(f"\nkernel efficiency (the one fitted constant): targets.json {stored:.3f}; this run's fit on "
          f"{FIT_ON[0]} GPU {NAMES[FIT_ON[1]]}: {fitted:.3f}"
          f"{'' if abs(fitted - stored) < 0.005 else ' -- DIFFERENT: put the fit in targets.json'}")
    off = [r for r in table if not 1 / 1.5 <= r["ratio"] <= 1.5]
    print("every ratio within 1.5x" if not off else
          f"{len(off)} ratio(s) off by more than 1.5x: see docs/gpu.md 'How good is the estimate'")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "fitted_efficiency": fitted, "stored_efficiency": stored}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
