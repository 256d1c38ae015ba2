"""What K steps per call cost to compile: one step, K steps in a loop, K steps unrolled (``Trainer.steps``).

    python tools/steps_compile_time.py [--model lenet] [--steps 8] [--repeats 3]

For oneDNN's and XLA's convolutions, fp32, under jit on 1 and 2 and shard_map on 2 virtual CPU devices: the
seconds ``lower`` and ``compile`` take (the median of ``--repeats``, each a new program: another learning rate,
so no compile is a cached one), after one compile that warms XLA up. docs/train-step.md, "Many steps per call".
"""

import argparse
import statistics
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lenet", help="a jaxtrain.models name (default lenet)")
    parser.add_argument("--steps", type=int, default=8, help="K, the steps per call (default 8)")
    parser.add_argument("--batch", type=int, default=32, help="the global batch of a step (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="compiles per figure, their median (default 3)")
    args = parser.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    import optax

    import jaxtrain as jt
    from jaxtrain import models

    lrs = iter(0.1 + 1e-4 * i for i in range(1, 10_000))  # each compile another program
    batch = models.get(args.model, conv="xla").example_batch(args.batch)
    batches = {k: np.stack([v] * args.steps) for k, v in batch.items()}

    variables = models.get(args.model, conv="xla").init(jax.random.key(0))

    def seconds(model, n, strategy, lower):
        trainer = jt.make_train_step(model.loss_fn, optax.sgd(next(lrs)), mesh=n, strategy=strategy)
        state = trainer.init(*variables)
        start = time.perf_counter()
        lowered = lower(trainer, state)
        middle = time.perf_counter()
        lowered.compile()
        return middle - start, time.perf_counter() - middle

    ways = {"one step": lambda t, s: t.lower(s, batch),
            f"{args.steps} steps, loop": lambda t, s: t.lower_steps(s, batches),
            f"{args.steps} steps, unrolled": lambda t, s: t.lower_steps(s, batches, unroll=True)}
    seconds(models.get(args.model, conv="xla"), 2, "jit", ways["one step"])  # XLA's own start-up
    print(f"{'conv':7} {'strategy':10} {'devices':>7}  {'program':18} {'lower s':>8} {'compile s':>10}")
    for conv in ("onednn", "xla"):
        model = models.get(args.model, conv=conv)
        for n, strategy in ((1, "jit"), (2, "jit"), (2, "shard_map")):
            for way, lower in ways.items():
                times = [seconds(model, n, strategy, lower) for _ in range(args.repeats)]
                low, comp = (statistics.median(t[i] for t in times) for i in (0, 1))
                print(f"{model.conv:7} {strategy:10} {n:>7}  {way:18} {low:8.2f} {comp:10.2f}", flush=True)


if __name__ == "__main__":
    main()
