"""Benchmark pipeline schedules: the bubble measured next to theory, and per-stage memory with and without remat.

    python -m experiments.bench_pipeline [--devices 4] [--micro-batch 8] [--json FILE]

The ViT (8 blocks) + Adam, pipelined over S in {2, 4} stages (data = 1) with
M in {1, 2, 4, 8, 16} micro-batches of a FIXED size (the batch is M x
--micro-batch), gpipe and circular (repeats 2; it needs M >= S). Per row:
ms/step (median over interleaved repeats); the bubble counted by the step
itself (idle stage-ticks / all stage-ticks as the compiled schedule ran:
the ``pipeline_bubble`` metric); the timed bubble: with a fixed micro-batch every tick costs the same, so per (S,
schedule) the step times fit ``a + tick * (R*M + S - 1)`` (least squares
over M) and the bubble is the time of the S - 1 idle ticks over the step,
``tick * (S - 1) / step``; theory ``(S-1) / (R*M + S-1)``; and the compiled
per-device temp memory (XLA's memory_analysis) with remat none and full.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from experiments import harness
from jaxtrain.cli import one_line_errors, positive_int

MICROBATCHES = (1, 2, 4, 8, 16)


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_pipeline", __doc__, steps=3, repeats=3, json_out="the rows")
    p.add_argument("--devices", type=positive_int, default=4, help="devices: stage counts 2 and 4 must fit")
    p.add_argument("--micro-batch", type=positive_int, default=8, help="examples per micro-batch")
    p.add_argument("--stages", type=positive_int, nargs="+", default=[2, 4], help="stage counts")
    p.add_argument("--microbatches", type=positive_int, nargs="+", default=list(MICROBATCHES), help="M values")
    return p


def configs(stages, microbatches):
    for s in stages:
        for schedule, repeats in (("gpipe", 1), ("circular", 2)):
            for m in microbatches:
                if schedule == "gpipe" or m >= s:
                    yield s, schedule, repeats, m


def fit_tick(rows) -> float:
    """Least-squares slope of ms/step against the tick count R*M + S - 1."""
    xs = [r["ticks"] for r in rows]
    ys = [r["ms_per_step"] for r in rows]
    if len(set(xs)) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


@one_line_errors("bench_pipeline")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import jaxtrain as jt

    devices = jt.setup_devices(args.devices)
    if max(args.stages) > len(devices):
        raise jt.ConfigError(f"--stages {max(args.stages)} needs as many devices; there are {len(devices)}")
    import jax
    import optax

    from jaxtrain import models

    model = models.get("vit")
    embed_fn, stage_fn, head_loss_fn = model.stack.embed_fn, model.stack.stage_fn, model.stack.head_loss_fn
    runs, rows = [], []
    for s, schedule, repeats, m in configs(args.stages, args.microbatches):
        batch = model.example_batch(m * args.micro_batch, seed=m)
        row = {"stages": s, "schedule": schedule, "repeats": repeats, "microbatches": m, "ticks": repeats * m + s - 1}
        for remat in ("full", "none"):  # the timed trainer is the last: remat none
            trainer = jt.make_pipeline_step(embed_fn, stage_fn, head_loss_fn, optax.adam(1e-3),
                                            mesh=jt.make_mesh(devices[:s], axes={"data": 1, "stage": s}),
                                            microbatches=m, schedule=schedule, repeats=repeats, remat=remat)
            state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
            stats = jt.compiled_stats(trainer, state, batch, residuals=False)
            row[f"temp_mib_{remat}"] = stats["temp_bytes"] / 2**20
        state, metrics = trainer(state, batch)  # compile and warm up; the bubble as the schedule ran
        row["counted_bubble"] = float(metrics["pipeline_bubble"])
        runs.append(harness.Timed(trainer, state, trainer.shard(batch)))
        rows.append(row)
        harness.progress(f"compiled S={s} {schedule} M={m}")
    harness.interleave(runs, args.steps, args.repeats)
    for run, row in zip(runs, rows):
        row["ms_per_step"] = run.median
    for s in args.stages:
        for schedule in ("gpipe", "circular"):
            group = [r for r in rows if r["stages"] == s and r["schedule"] == schedule]
            tick = fit_tick(group)
            for r in group:
                r["tick_ms"] = tick
                r["timed_bubble"] = tick * (s - 1) / r["ms_per_step"]
    print(f"ViT ({model.name}) + Adam, micro-batch {args.micro_batch}, {devices[0].platform} devices, data = 1:")
    print(f"{'S':>2} {'schedule':>9} {'R':>2} {'M':>3} {'ticks':>5} {'ms/step':>8} {'tick ms':>7} "
          f"{'bubble: timed':>13} {'counted':>7} {'theory':>6} {'temp MiB none':>13} {'full':>6}")
    for r in rows:
        theory = (r["stages"] - 1) / (r["repeats"] * r["microbatches"] + r["stages"] - 1)
        r["theory_bubble"] = theory
        print(f"{r['stages']:>2} {r['schedule']:>9} {r['repeats']:>2} {r['microbatches']:>3} {r['ticks']:>5} "
              f"{r['ms_per_step']:>8.1f} {r['tick_ms']:>7.2f} {r['timed_bubble']:>13.1%} "
              f"{r['counted_bubble']:>7.1%} {theory:>6.1%} {r['temp_mib_none']:>13.2f} {r['temp_mib_full']:>6.2f}")
    harness.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
