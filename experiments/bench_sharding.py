"""Benchmark sharded state: ResNet-18 (or LeNet) + Adam under replicated / fsdp / zero1 / tp / fsdp+tp.

    python -m experiments.bench_sharding [--model resnet18] [--devices 4] [--batch-size 64] [--budget 600MiB]
        [--conv auto|onednn|xla]

Per setting, on one device of the mesh (XLA compiles one program per
device): compiled argument and temp bytes, the state's own bytes, ms/step
(median over repeats, the settings interleaved so that machine noise hits
them alike) and the collective bytes per step by kind, read from the
compiled HLO. Then the batch-size finder's largest batch within one fixed
budget, replicated vs fsdp. replicated, fsdp and zero1 use a 1-D mesh
(data=N); tp and fsdp+tp a 2-D one (data=N/2, model=2). zero1's collective
bytes are held against theory: each gradient fsdp shards reduce-scattered and
its new parameter all-gathered, the bytes of one all-reduce of it (XLA:CPU
under jit writes the reduce-scatter as an all-reduce and a slice:
``--strategy shard_map`` shows it as such).
"""

from __future__ import annotations

import argparse
import sys

from experiments import harness
from jaxtrain.choices import CONVS, STRATEGIES
from jaxtrain.cli import one_line_errors, positive_int

SETTINGS = ("replicated", "fsdp", "zero1", "tp", "fsdp+tp")
DATA_ONLY = ("replicated", "fsdp", "zero1")  # a 1-D mesh, any strategy


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_sharding", __doc__, steps=3, repeats=3)
    p.add_argument("--model", choices=("resnet18", "lenet"), default="resnet18", help="the model (both have tp rules)")
    p.add_argument("--devices", type=positive_int, default=4, help="devices (even: tp needs model=2)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="GLOBAL batch size")
    p.add_argument("--strategy", choices=STRATEGIES, default="jit",
                   help="strategy for replicated and fsdp (tp needs jit)")
    p.add_argument("--conv", choices=CONVS, default="auto",
                   help="convolutions: auto (oneDNN's where they build), onednn or xla (tp: oneDNN's calls take "
                        "whole weights, so GSPMD all-gathers them)")
    p.add_argument("--budget", default="600MiB", help="per-device budget for the batch-size finder (0: skip it)")
    return p


@one_line_errors("bench_sharding")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import jaxtrain as jt

    if args.devices % 2:
        raise jt.ConfigError(f"--devices {args.devices}: use an even count (tp splits over model=2)")
    devices = jt.setup_devices(args.devices)
    from jaxtrain.analysis.batch_size import parse_bytes

    budget = parse_bytes(args.budget) if args.budget not in ("0", "") else None
    import jax
    import optax

    from jaxtrain import models
    from jaxtrain.analysis.diagnostics import COLLECTIVES
    from jaxtrain.parallel import rules, sharding

    n = len(devices)
    model = models.get(args.model, conv=args.conv)
    variables = jax.jit(model.init)(jax.random.key(0))

    def batch_of(size):
        return model.example_batch(size, seed=size)

    def trainer_for(setting):
        axes = {"data": n} if setting in DATA_ONLY else {"data": n // 2, "model": 2}
        strategy = args.strategy if setting in DATA_ONLY else "jit"
        return jt.make_train_step(model.loss_fn, optax.adam(1e-3), mesh=jt.make_mesh(n, axes=axes),
                                  strategy=strategy, param_sharding=rules.preset(setting, model.logical_axes))

    batch = batch_of(args.batch_size)
    runs, rows = {}, {}
    for setting in SETTINGS:
        trainer = trainer_for(setting)
        state = trainer.init(*variables)
        stats = jt.compiled_stats(trainer, state, batch, residuals=False)
        runs[setting] = harness.warm_up(harness.Timed(trainer, state, batch))  # compile and warm up
        rows[setting] = {"state_mib": sharding.device_bytes(state) / 2**20,
                         "argument_mib": stats["argument_bytes"] / 2**20, "temp_mib": stats["temp_bytes"] / 2**20,
                         "collectives": stats["collectives"]}
        harness.progress(f"compiled {setting}")
    harness.interleave(runs.values(), args.steps, args.repeats)
    print(f"{args.model} + Adam, batch {args.batch_size}, {n} {devices[0].platform} devices, {model.conv} "
          "convolutions, per device:")
    kinds = [k for k in COLLECTIVES if any(k in r["collectives"] for r in rows.values())]
    print(f"{'setting':>10} {'state MiB':>9} {'args MiB':>8} {'temp MiB':>8} {'ms/step':>8} "
          + " ".join(f"{k + ' MiB':>20}" for k in kinds))
    for setting, row in rows.items():
        row["ms_per_step"] = runs[setting].median
        row["ms_spread"] = [min(runs[setting].ms), max(runs[setting].ms)]
        cells = [f"{row['collectives'][k]['bytes'] / 2**20:>11.2f} ({row['collectives'][k]['ops']:>3} ops)"
                 if k in row["collectives"] else f"{'-':>20}" for k in kinds]
        print(f"{setting:>10} {row['state_mib']:>9.1f} {row['argument_mib']:>8.1f} {row['temp_mib']:>8.1f} "
              f"{row['ms_per_step']:>8.0f} " + " ".join(cells))
    print(f"fsdp / replicated argument bytes: {rows['fsdp']['argument_mib'] / rows['replicated']['argument_mib']:.3f}")
    fsdp_state = runs["fsdp"].state
    theory = sum(x.nbytes for x in jax.tree.leaves(fsdp_state.params) if not x.sharding.is_fully_replicated) / 2**20
    z = rows["zero1"]["collectives"]
    got = {k: z[k]["bytes"] / 2**20 for k in ("reduce-scatter", "all-gather") if k in z}
    rows["zero1"]["theory_mib"] = theory
    print(f"zero1: {', '.join(f'{k} {v:.2f} MiB' for k, v in got.items())}; theory: {theory:.2f} MiB each (the "
          f"parameters fsdp shards), one all-reduce's bytes in all; state {rows['zero1']['state_mib']:.1f} MiB vs "
          f"replicated {rows['replicated']['state_mib']:.1f} and fsdp {rows['fsdp']['state_mib']:.1f}")
    results = {"settings": rows, "devices": n, "batch_size": args.batch_size, "conv": model.conv}
    if budget:
        from jaxtrain.analysis.batch_size import find_batch_size

        found = {}
        for setting in ("replicated", "fsdp"):
            trainer = trainer_for(setting)
            state = trainer.init(*variables)
            found[setting] = find_batch_size(trainer, state, batch_of, budget, max_batch=4096).batch_size
        print(f"largest batch within {budget / 2**20:,.0f} MiB per device: replicated {found['replicated']}, "
              f"fsdp {found['fsdp']}")
        results["largest_batch"] = {"budget_bytes": budget, **found}
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
