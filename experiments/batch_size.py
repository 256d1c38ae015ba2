"""How big a batch fits? Found from the compiled step's memory, without running it.

    python -m experiments.batch_size --model lenet --memory-budget 2GiB [--precision bf16 --remat full]

Compiles the train step at growing global batch sizes, reads XLA's memory
analysis per device, binary-searches the largest batch within the budget,
and fits memory = a + b x batch ("model memory + batch x per-example memory").
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain.choices import PRECISIONS, STRATEGIES
from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.models import names as model_names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.batch_size", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=model_names(side=28), default="lenet", help="model whose train step is compiled")
    p.add_argument("--memory-budget", default=None,
                   help="memory per device, like 2GiB or 512MiB (default: 90%% of the device's limit; "
                        "required on CPU, which reports none)")
    p.add_argument("--devices", type=positive_int, default=None, help="devices the batch is split over")
    p.add_argument("--strategy", choices=STRATEGIES, default="jit", help="data-parallel strategy")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="compute dtype")
    p.add_argument("--remat", default="none", help="remat policy per block")
    p.add_argument("--accum-steps", type=positive_int, default=1, help="micro-batches per update (scan)")
    p.add_argument("--max-batch", type=positive_int, default=2**16, help="largest batch to try")
    return p


@one_line_errors("batch_size", flags={"budget_bytes": "--memory-budget"})
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import jaxtrain as jt

    devices = jt.setup_devices(args.devices)
    import jax
    import optax

    from jaxtrain import models
    from jaxtrain.analysis.batch_size import find_batch_size, parse_bytes

    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    model = models.get(args.model, remat=args.remat)
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices),
                                 strategy=args.strategy, precision=args.precision, accum_steps=args.accum_steps)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))

    def make_batch(size):
        return model.example_batch(size)

    print(f"{args.model}: compiling the train step ({args.precision}, remat {args.remat}, "
          f"{len(devices)} {devices[0].platform} device(s)) at growing batch sizes ...", file=sys.stderr)
    result = find_batch_size(trainer, state, make_batch, budget, max_batch=args.max_batch,
                             progress=lambda b, m: print(f"  batch {b:>7}: {m / 2**20:10.2f} MiB per device",
                                                         file=sys.stderr, flush=True))

    print("\n| global batch | predicted MiB per device |\n|---|---|")
    for b, m in result.table:
        print(f"| {b} | {m / 2**20:.2f} |")
    print(f"\nfit: memory = {result.intercept_bytes / 2**20:.2f} MiB + {result.bytes_per_example / 2**10:.2f} KiB "
          f"x batch   (R^2 = {result.r2:.6f})")
    print(f"budget {result.budget_bytes / 2**20:,.0f} MiB per device -> batch {result.batch_size} "
          f"({result.predicted_bytes / 2**20:.2f} MiB); the next candidate, {result.next_batch_size}, needs "
          f"{result.next_bytes / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
