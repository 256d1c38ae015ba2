"""Precision x remat: step time, compiled memory, saved residuals and FLOPs of a train step.

    python -m experiments.bench_memory --model lenet --batch-sizes 1024
    python -m experiments.bench_memory --model resnet18 --batch-sizes 64,128

For each batch size, the configurations run interleaved (A B C D A B C D ...)
and each cell is the median ms/step over the repeats; memory figures are per
device, read from the compiled step (``jt.compiled_stats``).
"""

from __future__ import annotations

import argparse
import sys

from experiments import harness
from jaxtrain.cli import one_line_errors, positive_int, whole_numbers
from jaxtrain.models import names as model_names


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_memory", __doc__, steps=5, repeats=3)
    p.add_argument("--model", choices=model_names(side=28), default="lenet")
    p.add_argument("--devices", type=positive_int, default=2)
    p.add_argument("--batch-sizes", type=whole_numbers(1, "256,512"), default="256",
                   help="comma-separated global batch sizes")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated precisions")
    p.add_argument("--remats", default="none,full", help="comma-separated remat policies")
    return p


@one_line_errors("bench_memory")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import jaxtrain as jt

    devices = jt.setup_devices(args.devices)
    sizes = args.batch_sizes
    configs = [(p, r) for p in args.precisions.split(",") for r in args.remats.split(",")]
    import jax
    import optax

    from jaxtrain import models

    rows = []
    for size in sizes:
        batch = models.get(args.model).example_batch(size)
        runs, stats = {}, {}
        for precision, remat in configs:
            model = models.get(args.model, remat=remat)
            trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices), precision=precision)
            trainer.check_batch_size(size)
            state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
            stats[(precision, remat)] = jt.compiled_stats(trainer, state, batch)
            runs[(precision, remat)] = harness.warm_up(harness.Timed(trainer, state, trainer.shard(batch)), 2)
        harness.interleave(runs.values(), args.steps, args.repeats)
        for (precision, remat), run in runs.items():
            s = stats[(precision, remat)]
            rows.append((size, precision, remat, run.median, s["temp_bytes"] / 2**20, s["saved_residual_bytes"] / 2**20,
                         s["flops"] * len(devices) / 1e9))
        harness.progress(f"measured batch {size}")

    print(f"\n{args.model} train step on {len(devices)} {devices[0].platform} devices, jax {jax.__version__}; "
          f"memory per device, GFLOP per step (all devices), median of {args.repeats} x {args.steps} steps\n")
    print("| batch | precision | remat | ms/step | compiled temp MiB | saved residuals MiB | GFLOP/step |")
    print("|---|---|---|---|---|---|---|")
    for size, precision, remat, ms, temp, saved, gflop in rows:
        print(f"| {size} | {precision} | {remat} | {ms:.1f} | {temp:.1f} | {saved:.1f} | {gflop:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
