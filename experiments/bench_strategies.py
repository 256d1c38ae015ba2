"""Benchmark the data-parallel strategies on the d2l LeNet train step.

    python -m experiments.bench_strategies [--devices 1,2,4] [--batch-size 256]

For each device count, the strategies run interleaved (A B C D A B C D ...)
so that machine noise hits them alike; each cell is the median ms/step over
the repeats (after warm-up), with the spread (min-max) beside it.
"""

from __future__ import annotations

import argparse
import sys

from experiments import harness
from jaxtrain import models
from jaxtrain.cli import one_line_errors, positive_int


def parse_devices(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated device counts like 1,2,4, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"device counts must be >= 1, got {text!r}")
    return counts


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_strategies", __doc__, steps=20, repeats=7)
    p.add_argument("--devices", type=parse_devices, default=[1, 2, 4], help="device counts to measure")
    p.add_argument("--batch-size", type=positive_int, default=256, help="GLOBAL batch size")
    return p


@one_line_errors("bench_strategies")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import jaxtrain as jt

    jt.setup_devices(max(args.devices))
    import jax
    import optax

    from jaxtrain.models import lenet

    host_batch = models.get("lenet").example_batch(args.batch_size)
    results: dict[str, dict[int, list[float]]] = {s: {} for s in jt.STRATEGIES}
    for n in args.devices:
        runs = {}
        for strategy in jt.STRATEGIES:
            trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.2), mesh=n, strategy=strategy)
            trainer.check_batch_size(args.batch_size)
            batch = trainer.shard(host_batch)  # the step alone: batch already on the devices
            state = trainer.init(lenet.init_params(jax.random.key(0)))
            runs[strategy] = harness.warm_up(harness.Timed(trainer, state, batch), 3)  # compile + warm up
        harness.interleave(runs.values(), args.steps, args.repeats)
        for strategy, run in runs.items():
            results[strategy][n] = run.ms
        harness.progress(f"measured {n} device(s)")

    header = "| strategy | " + " | ".join(f"{n} device{'s' * (n > 1)}" for n in args.devices) + " |"
    print(f"\nLeNet train step, global batch {args.batch_size}, median ms/step (min-max of {args.repeats} repeats "
          f"x {args.steps} steps), {jax.devices()[0].platform}, jax {jax.__version__}\n")
    print(header)
    print("|" + "---|" * (len(args.devices) + 1))
    for strategy, by_n in results.items():
        print(f"| {strategy} | " + " | ".join(harness.spread(v) for v in by_n.values()) + " |")
    harness.write_json(args.json, {"batch_size": args.batch_size, "ms_per_step": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
