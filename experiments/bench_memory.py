"""Precision x remat: step time, compiled memory, saved residuals and FLOPs of a train step.

    python -m experiments.bench_memory --model lenet --batch-sizes 1024
    python -m experiments.bench_memory --model resnet18 --batch-sizes 64,128

For each batch size, the configurations run interleaved (A B C D A B C D ...)
and each cell is the median ms/step over the repeats; memory figures are per
device, read from the compiled step (``jt.compiled_stats``).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from jaxtrain.cli import one_line_errors, positive_int, whole_numbers
from jaxtrain.models import names as model_names
from jaxtrain.train.timing import time_steps


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_memory", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=model_names(side=28), default="lenet")
    p.add_argument("--devices", type=positive_int, default=2)
    p.add_argument("--batch-sizes", type=whole_numbers(1, "256,512"), default="256",
                   help="comma-separated global batch sizes")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated precisions")
    p.add_argument("--remats", default="none,full", help="comma-separated remat policies")
    p.add_argument("--steps", type=positive_int, default=5, help="steps timed per repeat")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats (median reported)")
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
        runs = {}
        for precision, remat in configs:
            model = models.get(args.model, remat=remat)
            trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices), precision=precision)
            trainer.check_batch_size(size)
            state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
            stats = jt.compiled_stats(trainer, state, batch)
            device_batch = trainer.shard(batch)
            state, _ = time_steps(trainer, state, device_batch, 2)  # compile + warm up
            runs[(precision, remat)] = [trainer, state, device_batch, stats, []]
        for _ in range(args.repeats):
            for run in runs.values():
                run[1], sec = time_steps(run[0], run[1], run[2], args.steps)
                run[4].append(1000 * sec)
        for (precision, remat), run in runs.items():
            stats = run[3]
            rows.append((size, precision, remat, statistics.median(run[4]), stats["temp_bytes"] / 2**20,
                         stats["saved_residual_bytes"] / 2**20, stats["flops"] * len(devices) / 1e9))
        print(f"measured batch {size}", file=sys.stderr, flush=True)

    print(f"\n{args.model} train step on {len(devices)} {devices[0].platform} devices, jax {jax.__version__}; "
          f"memory per device, GFLOP per step (all devices), median of {args.repeats} x {args.steps} steps\n")
    print("| batch | precision | remat | ms/step | compiled temp MiB | saved residuals MiB | GFLOP/step |")
    print("|---|---|---|---|---|---|---|")
    for size, precision, remat, ms, temp, saved, gflop in rows:
        print(f"| {size} | {precision} | {remat} | {ms:.1f} | {temp:.1f} | {saved:.1f} | {gflop:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
