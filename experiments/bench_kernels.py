"""What the Pallas kernels move and cost, next to XLA's own jnp versions: bytes, and time on this host.

    python -m experiments.bench_kernels [--batch-size 256] [--classes 10,1000] [--devices 2] [--json FILE]

Each kernel's forward + backward alone, per problem: the softmax
cross-entropy at batch x classes, the ViT's layer norm at its batch (64) x 49
tokens x 64 features. ``xla_bytes`` is XLA's compile-time count ("bytes
accessed", cost_analysis) of the jnp version and its gradient compiled for
this host; ``kernel_bytes`` is what the kernels read and write by
construction (every operand block, the per-block partial sums and their
reduction): what they would move on a GPU. For scale, the whole train step's
bytes (compiled_stats) of LeNet (batch --batch-size) and of the ViT (batch
64), jnp vs pallas. Then ms per call here: jnp vs the kernels in interpret
mode (an emulation on the CPU: it says nothing about GPUs).

    python -m experiments.bench_kernels --gpu h100   # needs the gpu-compile extra (docs/gpu.md)

instead compiles the same problems for one GPU of that kind (no GPU needed) and prints each Pallas kernel's launch:
grid, threads, shared memory and registers per thread (jaxtrain.gpu.launches), for Mosaic GPU (Hopper and newer,
jax >= 0.12) and Triton.
"""

from __future__ import annotations

import argparse
import sys

from experiments import harness
from jaxtrain.cli import one_line_errors, positive_int, whole_numbers


VIT_BATCH, VIT_DEPTH = 64, 8  # the ViT recipe's batch; its blocks


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_kernels", __doc__, steps=None, repeats=20, json_out="the figures")
    p.add_argument("--batch-size", type=positive_int, default=256, help="global batch (the loss sees all of it)")
    p.add_argument("--classes", type=whole_numbers(2, "10,1000"), default="10,1000",
                   help="comma-separated class counts for the loss alone")
    p.add_argument("--devices", type=positive_int, default=2, help="devices of the LeNet step (strategy jit)")
    p.add_argument("--gpu", metavar="NAME", help="print the kernels' per-launch resources compiled for this GPU "
                                                 "(h100, h200, b200, a100, v100) instead of timing them here")
    return p


def ce_kernel_bytes(batch: int, classes: int, itemsize: int = 4) -> int:
    """Bytes the cross-entropy kernels read + write (int32 labels, fp32 per-row values)."""
    logits, row = batch * classes * itemsize, batch * 4
    forward = logits + row + 2 * row  # in: logits, labels; out: loss, logsumexp
    backward = logits + 3 * row + logits  # in: logits, labels, logsumexp, cotangent; out: dlogits
    return forward + backward


def ln_kernel_bytes(rows: int, features: int, itemsize: int = 4) -> int:
    """Bytes the layer-norm kernels read + write, and the jnp sum of their partial sums."""
    from jaxtrain.kernels.rows import programs

    x, row, vector, blocks = rows * features * itemsize, rows * 4, features * 4, programs(rows, features)
    forward = x + 2 * blocks * vector + x + 2 * row  # in: x, scale + bias per program; out: y, mean, rstd
    backward = 2 * x + blocks * vector + 2 * row + x + 2 * blocks * vector  # in: x, dy, scale, stats; out: dx, partials
    return forward + backward + 2 * blocks * vector + 2 * vector  # the partials summed to dscale, dbias


def _xla_bytes(fn, *args) -> float:
    cost = fn.lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


def _both(fns: dict, args, repeats: int, problem: dict, kernel_bytes: int) -> dict:
    timed = harness.take_turns({k: harness.Call(f, args) for k, f in fns.items()}, repeats, in_a_row=True)
    return {**problem, "xla_bytes": _xla_bytes(fns["jnp"], *args), "kernel_bytes": kernel_bytes,
            "jnp_ms": timed["jnp"], "kernel_ms": timed["pallas"], "kernel_runs_as": _runs_as()}


def _runs_as() -> str:
    """How the Pallas kernels run here: emulated in interpret mode on a CPU, else the GPU backend rows picks."""
    import jax

    from jaxtrain.kernels import rows

    return "interpret" if jax.default_backend() == "cpu" else rows.backend()


def loss_figures(batch: int, classes: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from jaxtrain.models import classify

    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(size=(batch, classes)).astype(np.float32))
    labels = jax.device_put(rng.integers(0, classes, batch).astype(np.int32))
    grads = {k: jax.jit(jax.value_and_grad(lambda x, y, k=k: classify.cross_entropy(x, y, k).mean()))
             for k in ("jnp", "pallas")}
    return _both(grads, (logits, labels), repeats, {"kernel": "cross-entropy", "shape": f"{batch} x {classes}"},
                 ce_kernel_bytes(batch, classes))


def layer_norm_figures(batch: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from jaxtrain.kernels import layer_norm
    from jaxtrain.models import vit

    shape = (batch, vit.tokens(vit.IMAGE_SHAPE), vit.DIM)
    rng = np.random.default_rng(0)
    x, dy = (jax.device_put(rng.normal(size=shape).astype(np.float32)) for _ in range(2))
    scale, bias = jax.device_put(np.ones(vit.DIM, np.float32)), jax.device_put(np.zeros(vit.DIM, np.float32))
    grads = {k: jax.jit(jax.grad(lambda x, s, b, dy, f=f: (f(x, s, b) * dy).sum(), argnums=(0, 1, 2)))
             for k, f in (("jnp", layer_norm.reference), ("pallas", layer_norm.layer_norm))}
    rows = shape[0] * shape[1]
    return _both(grads, (x, scale, bias, dy), repeats, {"kernel": "layer norm", "shape": f"{rows} x {vit.DIM}"},
                 ln_kernel_bytes(rows, vit.DIM))


def step_figures(name: str, batch: int, devices: int, repeats: int) -> dict:
    import jax
    import optax

    import jaxtrain as jt
    from jaxtrain import models
    from jaxtrain.analysis import diagnostics

    step_bytes, runs = {}, {}
    for kernels in ("jnp", "pallas"):
        model = models.get(name, kernels=kernels)
        trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices))
        state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
        host = model.example_batch(batch)
        step_bytes[kernels] = diagnostics.compiled_stats(trainer, state, host, residuals=False)["bytes_accessed"]
        runs[kernels] = harness.warm_up(harness.Timed(trainer, state, trainer.shard(host)), 2)
    harness.interleave(runs.values(), 1, repeats)  # one step per repeat, jnp and pallas taking turns
    return {k: {"step_bytes": step_bytes[k], "step_ms": run.median} for k, run in runs.items()}


def gpu_launches(gpu_name: str, batch: int, classes: list[int]) -> list[dict]:
    """Each Pallas kernel's launch (jaxtrain.gpu.launches) for the loss at batch x each class count and the
    ViT's layer norm, compiled for one ``gpu_name``, with every backend that GPU takes (Mosaic GPU, Triton)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxtrain.gpu as gpu
    from jaxtrain import settings
    from jaxtrain.gpu import analysis, launches
    from jaxtrain.kernels import layer_norm, rows, softmax_ce
    from jaxtrain.models import vit

    mesh = gpu.mesh_for(gpu_name, gpus=1)

    def shape(s, dt=jnp.float32):  # replicated on the GPU
        return jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P()))

    def ce(x, y):
        return jax.value_and_grad(lambda z: softmax_ce.cross_entropy(z, y).mean())(x)

    ln = jax.grad(lambda x, s, b: layer_norm.layer_norm(x, s, b).sum(), argnums=(0, 1, 2))
    ln_rows = VIT_BATCH * vit.tokens(vit.IMAGE_SHAPE)
    problems = [(f"cross-entropy {batch} x {c}", ce, (shape((batch, c)), shape((batch,), jnp.int32))) for c in classes]
    problems.append((f"layer norm {ln_rows} x {vit.DIM}", ln, (shape((ln_rows, vit.DIM)), shape((vit.DIM,)),
                                                              shape((vit.DIM,)))))
    with jax.set_mesh(mesh):
        backends = ["mosaic", "triton"] if rows.backend(jax.sharding.get_abstract_mesh()) == "mosaic" else ["triton"]
    out = []
    for backend in backends:
        with settings.override(pallas_gpu=backend):  # rows.backend reads it as the kernels are traced
            for problem, fn, args in problems:
                with jax.set_mesh(mesh):
                    lowered = jax.jit(lambda *a, fn=fn: fn(*a)).lower(*args)
                _, found = launches.compile_with_launches(lowered, analysis.AUTOTUNER_OFF)
                out += [{"problem": problem, **vars(k)} for k in found if k.backend in ("mosaic", "triton")]
    return out


def print_gpu_launches(gpu_name: str, found: list[dict]) -> None:
    print(f"The Pallas kernels compiled for one {gpu_name} (forward + backward; no GPU used):\n")
    print("| problem | kernel | backend | grid | threads | shared memory | registers per thread |")
    print("|---|---|---|---|---|---|---|")
    for k in found:
        regs = k["registers"] if k["registers"] is not None else "at first run"
        print(f"| {k['problem']} | {k['name']} | {k['backend']} | {'x'.join(map(str, k['grid']))} | {k['threads']} | "
              f"{k['shared_bytes']:,} B | {regs} |")
    print("\nMosaic GPU compiles its kernels to GPU code when they first run, so their registers are known only "
          "on a GPU; Triton's come from the cubins XLA builds at compile time.")


@one_line_errors("bench_kernels")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    classes = args.classes
    if args.gpu:
        found = gpu_launches(args.gpu, args.batch_size, classes)
        print_gpu_launches(args.gpu, found)
        harness.write_json(args.json, {"gpu": args.gpu, "launches": found})
        return 0
    import jaxtrain as jt

    jt.setup_devices(args.devices)
    rows = [loss_figures(args.batch_size, c, args.repeats) for c in classes]
    rows.append(layer_norm_figures(VIT_BATCH, args.repeats))
    steps = {"lenet": step_figures("lenet", args.batch_size, args.devices, args.repeats),
             "vit": step_figures("vit", VIT_BATCH, args.devices, args.repeats)}
    print("Each kernel's forward + backward alone:\n")
    print(f"| kernel | rows x columns | XLA bytes (jnp) | kernel bytes | ratio | ms jnp | ms kernel ({_runs_as()}) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['xla_bytes']:,.0f} | {r['kernel_bytes']:,} | "
              f"{r['kernel_bytes'] / r['xla_bytes']:.2f} | {r['jnp_ms']:.3f} | {r['kernel_ms']:.3f} |")
    print(f"\nWhole train steps on {args.devices} device(s) (strategy jit; LeNet batch {args.batch_size}, ViT batch "
          f"{VIT_BATCH}):\n")
    print("| model | kernels | step bytes (XLA, this host) | ms per step |")
    print("|---|---|---|---|")
    for name, step in steps.items():
        for k, v in step.items():
            print(f"| {name} | {k} | {v['step_bytes']:,.0f} | {v['step_ms']:.2f} |")
    ln, ce = rows[-1], next((r for r in rows if r["shape"].endswith(" x 10")), rows[0])
    print(f"\nLeNet's loss (batch x 10) is {ce['xla_bytes'] / steps['lenet']['jnp']['step_bytes']:.2%} of its "
          f"step's bytes; one ViT layer norm is {ln['xla_bytes'] / steps['vit']['jnp']['step_bytes']:.2%} of the "
          f"ViT step's, and the step has {2 * VIT_DEPTH + 1} (XLA's counts on this host).")
    harness.write_json(args.json, {"kernels": rows, "steps": steps, "batch_size": args.batch_size,
                                   "devices": args.devices})
    return 0


if __name__ == "__main__":
    sys.exit(main())
