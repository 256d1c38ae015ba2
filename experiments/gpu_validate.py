"""The step-time estimate held against measurements: ResNet-50 v1.5 training on V100s, A100s, H100s and H200s.

    python -m experiments.gpu_validate              # 14 compiles of ResNet-50, one per row (minutes on 2 cores)
    python -m experiments.gpu_validate --gpu a100   # the A100 rows only
    python -m experiments.gpu_validate --no-cache   # every row compiled anew (default: unchanged programs' text
                                                    # read back from ~/.cache/jaxtrain/gpu-compiled)

Exits 1 when a held-out row's ratio leaves the band docs/gpu-estimate.md states (``band``, ``verdict``: 1.5x either
way; MLPerf's tuned implementations 0.5-1.0, a floor the measured runs set: ``mlperf_floor``).

NVIDIA's DeepLearningExamples (PyTorch/Classification/ConvNets/resnet50v1.5/README.md, pytorch-21.03 container)
publishes training images/s on a DGX A100 (8x A100 80GB: TF32 and mixed precision, 256 images per GPU) and a
DGX-1 (8x V100 16GB: FP32 at 112 images per GPU, mixed precision at 256; configs.yml). The same network
(``jaxtrain.models.resnet50``: 224x224x3, 1000 classes, SGD with momentum) is compiled here for 1 and 8 GPUs:
fp32 (on A100, XLA runs f32 convolutions and matmuls as TF32), and for mixed precision bf16 on A100 (its bf16
and fp16 peaks are equal) and fp16 with loss scaling on V100 (no bf16 there); its step time is estimated
(``jaxtrain.gpu.estimate``).

MLPerf Training's ResNet-50 closed-division logs add H100 and H200 rows (``MLPERF``): v3.0, 8x H100 SXM, 400
images per GPU, 55,923-56,206 img/s in steady state; v4.0, 8x H200, 400 per GPU, 63,394-63,862 (the midpoints are
compared). Their implementations are heavily tuned (DALI, fused NHWC kernels): a gap is expected, and the
H200/H100 ratio (1.13x measured, against 1.43x more memory bandwidth) tests whether the estimate over-credits
bandwidth. And jaxtrain's own step as ``python -m experiments.gpu_check`` measured it on each GPU run kept in
docs/gpu-runs/ (one H200 on 2026-11-26, one H100 on 2026-11-27: docs/gpu.md): the rows where estimate and
measurement are of the same program, read from those reports when the command runs (``figures``), never typed in
here. It names the run files it read; none, or two holding the same GPU, GPU count and batch, is one line, exit 1.

The estimate has one fitted constant, the share of their rooflines kernels reach (``targets.json``
"_costs.efficiency"). It is fitted on ONE row, 1 A100 AMP; every other row is held out. This command prints the
fit it finds and says so if ``targets.json`` holds another value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.gpu_check_report import RUNS, kept_runs
from jaxtrain.cli import one_line_errors
from jaxtrain.errors import ConfigError

# NVIDIA's published figures (the README named above): (gpu, GPUs, jaxtrain precision, images per GPU, name) -> img/s
PUBLISHED = {("a100", 1, "fp32", 256, "TF32"): 938, ("a100", 1, "bf16", 256, "AMP"): 2470,
             ("a100", 8, "fp32", 256, "TF32"): 7248, ("a100", 8, "bf16", 256, "AMP"): 16621,
             ("v100", 1, "fp32", 112, "FP32"): 367, ("v100", 1, "fp16", 256, "AMP"): 1200,
             ("v100", 8, "fp32", 112, "FP32"): 2855, ("v100", 8, "fp16", 256, "AMP"): 8322}
MEASURED = "bf16 (jaxtrain, measured)"


def measured(runs: dict) -> dict:
    """jaxtrain's ResNet-50 step (bf16, 224x224, no remat) in each kept GPU run's report (``runs``: ``kept_runs``,
    by name): (gpu, GPUs, precision, images per GPU, name) -> img/s measured. Two rows of one cell (two runs of the
    same GPU, say) are a ConfigError naming both: neither silently wins."""
    out, where = {}, {}
    for name, run in runs.items():
        for r in run.get("steps", {}).get("rows", []):
            if (r.get("model"), r.get("precision"), r.get("remat"), r.get("input_shape")) != (
                    "resnet50", "bf16", "none", [224, 224, 3]):
                continue
            key = (run["run"]["gpu"], r["devices"], "bf16", r["batch"] // r["devices"], MEASURED)
            if key in out:
                raise ConfigError(f"{where[key]}.json and {name}.json both measure {key[0].upper()} x{key[1]} at "
                                  f"{key[3]} images per GPU: keep one of them in the runs folder")
            out[key], where[key] = r["examples_per_second"], name
    return out


# Held out, every one (the fit stays on the 1-A100 AMP row): (gpu, GPUs, precision, images per GPU, name) -> img/s
MLPERF = {("h100", 8, "bf16", 400, "AMP (MLPerf v3.0)"): (55_923 + 56_206) / 2,
          ("h200", 8, "bf16", 400, "AMP (MLPerf v4.0)"): (63_394 + 63_862) / 2}
FIT_ON = ("a100", 1, "bf16", 256, "AMP")
BAND = 1.5  # docs/gpu-estimate.md: every ratio "within 1.5x" of an implementation like the one estimated...
MLPERF_BAND = (0.5, 1.0)  # ...and "0.5-1.0" of MLPerf's tuned ones (mlperf_floor: why 0.5)


def figures(runs: dict) -> dict:
    """Every row's measured figure, (gpu, GPUs, precision, images per GPU, name) -> img/s: NVIDIA's published ones,
    MLPerf's and jaxtrain's in ``runs`` (``kept_runs``; ``measured``). All but ``FIT_ON`` are held out."""
    return {**PUBLISHED, **MLPERF, **measured(runs)}


def read_runs(folder: Path = RUNS) -> tuple[dict, str]:
    """(``figures`` of the runs kept in ``folder``, the line naming the files read); a ConfigError where it holds
    no run with a measured row (they would silently be left out) or two measure the same cell."""
    runs = kept_runs(folder)
    cells = figures(runs)
    if not any(key[4] == MEASURED for key in cells):
        raise ConfigError(f"{folder}: no GPU run file (DATE-GPU.json) with jaxtrain's ResNet-50 row "
                          f"({len(runs)} file(s) there): the measured rows would be left out "
                          "(python -m experiments.gpu_check --keep writes one)")
    return cells, f"jaxtrain's measured rows from {folder}: " + ", ".join(f"{name}.json" for name in runs)


def band(row: dict) -> tuple[float, float]:
    """The ratios (estimate / measured) a held-out row may have, as docs/gpu-estimate.md states them."""
    return MLPERF_BAND if "MLPerf" in row["precision"] else (1 / BAND, BAND)


def mlperf_floor(held_out: dict) -> dict:
    """The lowest ratio an estimate of XLA's program may have against MLPerf's tuned code, per GPU, from the
    measurements: jaxtrain's step measured at MLPerf's 400 images per GPU runs at a share S of MLPerf's per-GPU
    throughput, and an estimate within its own band may be 1/BAND of that step's: so S / BAND. ``held_out``: as
    ``figures`` gives them."""
    out = {}
    for (gpu, gpus, _, batch, name), rate in held_out.items():
        if "MLPerf" in name:
            ours = held_out.get((gpu, 1, "bf16", batch, MEASURED))
            if ours:
                out[gpu] = ours / (rate / gpus) / BAND
    return out


def outside(table: list[dict]) -> list[dict]:
    """The held-out rows whose ratio leaves its band."""
    return [r for r in table if r["held_out"] and not band(r)[0] <= r["ratio"] <= band(r)[1]]


def verdict(table: list[dict]) -> tuple[str, int]:
    """The command's last line and exit code: 1 when a held-out row leaves its band."""
    off = outside(table)
    if not off:
        return f"every ratio within {BAND}x, MLPerf's within {MLPERF_BAND[0]}-{MLPERF_BAND[1]}", 0
    return (f"{len(off)} held-out ratio(s) outside their band ("
            + ", ".join(f"{r['gpu'].upper()} x{r['gpus']} {r['precision']}: {r['ratio']:.2f}" for r in off)
            + "): the estimate has left the band docs/gpu-estimate.md states ('How good is the estimate')"), 1


MLPERF_H200_OVER_H100 = MLPERF[("h200", 8, "bf16", 400, "AMP (MLPerf v4.0)")] / MLPERF[
    ("h100", 8, "bf16", 400, "AMP (MLPerf v3.0)")]
SOURCE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md: DGX A100 "
          "(8x A100 80GB) and DGX-1 (8x V100 16GB)")


def parser() -> argparse.ArgumentParser:
    from jaxtrain.gpu.targets import names

    p = argparse.ArgumentParser(prog="python -m experiments.gpu_validate", description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=names(), action="append",
                   help="only these GPUs' rows (repeatable; default: all; the fit needs a100)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    p.add_argument("--no-cache", action="store_true",
                   help="compile every row anew (default: a row whose lowered program, GPU target and jax versions "
                        "match an earlier compile's reads that compile's program text from $JAXTRAIN_GPU_COMPILED, "
                        "~/.cache/jaxtrain/gpu-compiled: the estimate is computed from it again)")
    return p


def fit_efficiency(roofline: float, launch: float, seconds: float) -> float:
    """The kernel efficiency that makes a program without communication take ``seconds``: its kernels'
    rooflines over the time they leave after the launches."""
    return roofline / (seconds - launch)


def rows(estimates: dict, cells: dict) -> list[dict]:
    """The table: one row per measured cell with the estimate, the measured figure and their ratio;
    ``estimates``: cell (a key of ``cells``, ``figures``' dict) -> ``Estimate.summary()``."""
    out = []
    for key, e in estimates.items():
        gpu, gpus, _, batch, name = key
        out.append({"gpu": gpu, "gpus": gpus, "precision": name, "batch_per_gpu": batch,
                    "estimate": e["examples_per_second"], "published": cells[key],
                    "ratio": e["examples_per_second"] / cells[key], "held_out": key != FIT_ON,
                    "bottleneck": e["bottleneck"], "exposed_share": e["exposed"] / e["seconds"]})
    return out


def format_rows(table: list[dict]) -> str:
    lines = ["| GPU | GPUs | precision | batch per GPU | estimate img/s | measured img/s | ratio | row |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        waits = f"; {r['exposed_share']:.1%} of the step waits for collectives" if r["gpus"] > 1 else ""
        lines.append(f"| {r['gpu'].upper()} | {r['gpus']} | {r['precision']} | {r['batch_per_gpu']} | "
                     f"{r['estimate']:,.0f} | {r['published']:,} | {r['ratio']:.2f} | "
                     f"{'held out' if r['held_out'] else 'fitted'}; {r['bottleneck']}-bound{waits} |")
    return "\n".join(lines)


def estimate(cells: list[tuple], folder: Path | None = None) -> dict:
    """Each cell's ``Estimate.summary()``: ResNet-50 compiled for its GPUs (the gpu-compile extra), or its
    program's text read from ``folder``, where an earlier compile of the same inputs kept it
    (``jaxtrain.gpu.analysis.compiled_text``: the lowered program, the target, the versions)."""
    from jaxtrain import gpu
    from jaxtrain.gpu.plan import estimated

    gpu.check_plugin()
    estimates = {}
    for key in cells:
        name, gpus, precision, batch, label = key
        print(f"ResNet-50 for {gpus} x {name.upper()}, {label}, {batch * gpus} images: ", end="", file=sys.stderr,
              flush=True)
        estimates[key], kept = estimated(folder, gpu=name, gpus=gpus, hosts=1, model="resnet50",
                                         precision=precision, batch_size=batch * gpus, input_shape=(224, 224, 3),
                                         num_classes=1000)
        print(f"its program read from {folder}" if kept else "compiled", file=sys.stderr, flush=True)
    return estimates


@one_line_errors("gpu_validate")
def main(argv=None, estimate=estimate, runs: Path = RUNS) -> int:
    """``estimate``: cells -> their estimates (tests stand a stub in for the compiles); ``runs``: the folder of kept
    GPU runs whose measured rows are compared (docs/gpu-runs)."""
    p = parser()
    args = p.parse_args(argv)
    import json

    from jaxtrain.gpu.targets import costs

    try:
        cells, read = read_runs(runs)
    except ConfigError as e:  # the comparison cannot be made as documented: a failed check (1), not a usage error
        print(f"gpu_validate: error: {e}", file=sys.stderr)
        return 1
    if args.gpu and (rowless := sorted(set(args.gpu) - {k[0] for k in cells})):
        p.error(f"argument --gpu: no rows of {', '.join(rowless)} (rows: {', '.join(sorted({k[0] for k in cells}))})")
    print(read, flush=True)
    from jaxtrain import settings

    folder = None if args.no_cache else settings.current().gpu_compiled
    estimates = estimate([k for k in cells if args.gpu is None or k[0] in args.gpu], folder)
    table = rows(estimates, cells)
    print(f"ResNet-50 v1.5 training: the ESTIMATE against measurements ({SOURCE}; MLPerf Training v3.0 and v4.0 "
          "closed-division logs; jaxtrain on one H200 and one H100, experiments.gpu_check)\n")
    print(format_rows(table))
    stored = costs().efficiency
    fitted = None
    if FIT_ON in estimates:
        e = estimates[FIT_ON]
        fitted = fit_efficiency(e["roofline"], e["launch"], FIT_ON[3] * FIT_ON[1] / PUBLISHED[FIT_ON])
        print(f"\nkernel efficiency (the one fitted constant): targets.json {stored:.3f}; this run's fit on 1 A100 "
              f"AMP: {fitted:.3f}"
              f"{'' if abs(fitted - stored) < 0.005 else ' -- DIFFERENT: put the fit in targets.json'}")
    pair = [estimates.get(k) for k in MLPERF]
    if all(pair):
        from jaxtrain.gpu.targets import target

        bandwidth = target("h200").memory_bandwidth_gbps / target("h100").memory_bandwidth_gbps
        print(f"H200/H100 (8 GPUs, 400 per GPU): estimate "
              f"{pair[1]['examples_per_second'] / pair[0]['examples_per_second']:.2f}x, MLPerf "
              f"{MLPERF_H200_OVER_H100:.2f}x (memory bandwidth {bandwidth:.2f}x)")
    for batch in (256, 400):
        ours = [(name, 1, "bf16", batch, MEASURED) for name in ("h200", "h100")]
        if all(k in estimates for k in ours):
            print(f"H200/H100 (jaxtrain's step, 1 GPU, {batch} per GPU): estimate "
                  f"{estimates[ours[0]]['examples_per_second'] / estimates[ours[1]]['examples_per_second']:.2f}x, "
                  f"measured {cells[ours[0]] / cells[ours[1]]:.2f}x")
    floors = ", ".join(f"{gpu.upper()} {f:.3f}" for gpu, f in mlperf_floor(cells).items())
    if floors:
        print(f"MLPerf's floor from the measured runs (jaxtrain's step over MLPerf's per GPU, over {BAND}): {floors}")
    line, code = verdict(table)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "fitted_efficiency": fitted, "stored_efficiency": stored}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
