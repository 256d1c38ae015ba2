"""What the Pallas cross-entropy kernel moves and costs, next to XLA's own loss: bytes, and time on this host.

    python -m experiments.bench_kernels [--batch-size 256] [--classes 10,1000] [--devices 2] [--json FILE]

Per problem size (batch x classes), the loss's forward + backward alone:
``xla_bytes`` is XLA's compile-time count ("bytes accessed", cost_analysis)
of the jnp loss and its gradient compiled for this host; ``kernel_bytes`` is
what the two kernels read and write by construction (forward: logits and
labels in, loss and logsumexp out; backward: logits, labels, logsumexp and
the cotangent in, the logits' gradient out): what they would move on a GPU.
For scale, the whole LeNet train step's bytes (compiled_stats) at the same
batch. Then ms per call here: the jnp loss, the kernel in interpret mode,
and the LeNet step with ``kernels="jnp"`` vs ``"pallas"`` (interpret mode is
an emulation on the CPU: it measures nothing about GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxtrain.cli import positive_int
from jaxtrain.timing import median_seconds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_kernels", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-size", type=positive_int, default=256, help="global batch (the loss sees all of it)")
    p.add_argument("--classes", default="10,1000", help="comma-separated class counts for the loss alone")
    p.add_argument("--devices", type=positive_int, default=2, help="devices of the LeNet step (strategy jit)")
    p.add_argument("--repeats", type=positive_int, default=20, help="timed calls (median reported)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    return p


def kernel_bytes(batch: int, classes: int, itemsize: int = 4) -> int:
    """Bytes the forward and backward kernels read + write (int32 labels, fp32 per-row values)."""
    logits, row = batch * classes * itemsize, batch * 4
    forward = logits + row + 2 * row  # in: logits, labels; out: loss, logsumexp
    backward = logits + 3 * row + logits  # in: logits, labels, logsumexp, cotangent; out: dlogits
    return forward + backward


def loss_figures(batch: int, classes: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from jaxtrain.models import classify

    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(size=(batch, classes)).astype(np.float32))
    labels = jax.device_put(rng.integers(0, classes, batch).astype(np.int32))
    grads = {k: jax.jit(jax.value_and_grad(lambda x, y, k=k: classify.cross_entropy(x, y, k).mean()))
             for k in ("jnp", "pallas")}
    cost = grads["jnp"].lower(logits, labels).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    timed = {k: 1000 * median_seconds(lambda f=f: jax.block_until_ready(f(logits, labels)), repeats)
             for k, f in grads.items()}
    return {"batch": batch, "classes": classes, "xla_bytes": float(cost["bytes accessed"]),
            "kernel_bytes": kernel_bytes(batch, classes), "jnp_ms": timed["jnp"], "interpret_ms": timed["pallas"]}


def step_figures(batch: int, devices: int, repeats: int) -> dict:
    import jax
    import optax

    import jaxtrain as jt
    from jaxtrain import diagnostics, models

    out = {}
    for kernels in ("jnp", "pallas"):
        model = models.get("lenet", kernels=kernels)
        trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices))
        state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
        host = model.example_batch(batch)
        stats = diagnostics.compiled_stats(trainer, state, host, residuals=False)
        sharded = trainer.shard(host)
        holder = [state]

        def step():
            holder[0], metrics = trainer(holder[0], sharded)
            jax.block_until_ready(metrics)

        step()
        out[kernels] = {"step_bytes": stats["bytes_accessed"], "step_ms": 1000 * median_seconds(step, repeats)}
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        classes = [int(c) for c in args.classes.split(",")]
        if min(classes) < 2:
            raise ValueError
    except ValueError:
        print("bench_kernels: error: --classes takes class counts >= 2 like 10,1000", file=sys.stderr)
        return 2
    import jaxtrain as jt

    jt.setup_devices(args.devices)
    rows = [loss_figures(args.batch_size, c, args.repeats) for c in classes]
    step = step_figures(args.batch_size, args.devices, args.repeats)
    print(f"softmax cross-entropy, forward + backward, batch {args.batch_size}:\n")
    print("| classes | XLA bytes (jnp) | kernel bytes | ms jnp | ms kernel (interpret) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['classes']} | {r['xla_bytes']:,.0f} | {r['kernel_bytes']:,} | {r['jnp_ms']:.3f} | "
              f"{r['interpret_ms']:.3f} |")
    print(f"\nLeNet train step, batch {args.batch_size} on {args.devices} device(s) (strategy jit):\n")
    print("| kernels | step bytes (XLA, this host) | ms per step |")
    print("|---|---|---|")
    for k, v in step.items():
        print(f"| {k} | {v['step_bytes']:,.0f} | {v['step_ms']:.2f} |")
    ten = next((r for r in rows if r["classes"] == 10), rows[0])
    print(f"\nThe loss is {ten['xla_bytes'] / step['jnp']['step_bytes']:.2%} of the step's bytes at "
          f"{ten['classes']} classes (XLA's count on this host).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loss": rows, "lenet_step": step, "batch_size": args.batch_size, "devices": args.devices}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
