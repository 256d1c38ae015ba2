"""jaxtrain's train step vs a hand-written jax.jit step vs PyTorch, interleaved in one run.

    python -m experiments.bench [--model lenet|resnet18] [--json F]

(a) jaxtrain's step with the defaults a user gets (make_train_step, default
strategy and devices); (b) a minimal hand-written ``jax.jit`` SGD step of the
same model on the same devices (the overhead reference); (c) PyTorch on the
CPU with ``torch.set_num_threads(cores)``, in its own process, when torch is
importable (``pip install torch==2.13.0``); (d) an epoch through the real input
pipeline: wall time vs steps x step time. A B C, B C A, C A B ... (rotated), warm-up excluded,
median and spread of the repeats. Batch 256 for LeNet, 64 for ResNet-18.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.models import names as model_names

# Worker threads (XLA's, PyTorch's OpenMP) keep spinning for a while after a
# step and steal the cores from whatever runs next. So every timed block
# starts with a pause (the previous variant's threads go to sleep), then a few
# untimed steps of its own (its threads wake up).
COOL_DOWN_SEC = 0.3
SETTLE_STEPS = 3

# What one H100 sustains in practice (measured figures quoted in issue 9, not
# datasheet peaks): dense bf16 matmul FLOP/s and HBM bytes/s.
H100_BF16_FLOPS, H100_BYTES_PER_S = 790e12, 3.0e12


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=model_names(), default="lenet")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="virtual CPU devices for jaxtrain and the hand-written step (default: one per core; "
                        "PyTorch always gets every core as threads)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="global batch (default: 256 LeNet, 64 ResNet-18)")
    p.add_argument("--steps", type=positive_int, default=None, help="steps per timed block (default: 10 LeNet, 3 ResNet-18)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed blocks per variant (default: 40 LeNet, 10 ResNet-18; noisy machines: more)")
    p.add_argument("--epoch-steps", type=positive_int, default=None,
                   help="steps of the pipeline epoch (default: a full epoch for LeNet, 30 for ResNet-18)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--xla-defaults", action="store_true",
                   help="compile with XLA's default CPU flags instead of jaxtrain's (sets JAXTRAIN_XLA_DEFAULTS=1)")
    p.add_argument("--no-materialize", action="store_true",
                   help="let XLA:CPU recompute the models' stored activations (jaxtrain.remat.materialize off; "
                        "sets JAXTRAIN_NO_MATERIALIZE=1)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if it is installed")
    p.add_argument("--torch-python", default=None, metavar="PYTHON",
                   help="run the PyTorch side with this interpreter (e.g. a Python 3.11 venv with torch==2.13.0 "
                        "beside a jax 0.12 one; default: this interpreter)")
    return p


@one_line_errors("bench")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    lenet_model = args.model == "lenet"
    args.batch_size = args.batch_size or (256 if lenet_model else 64)
    args.steps = args.steps or (10 if lenet_model else 3)
    args.repeats = args.repeats or (40 if lenet_model else 10)
    args.epoch_steps = args.epoch_steps or (None if lenet_model else 30)
    from experiments import bench_torch

    use_torch = not args.no_torch and bench_torch.available(args.torch_python)
    if args.torch_python and not args.no_torch and not use_torch:
        print(f"bench: error: --torch-python {args.torch_python} cannot import torch", file=sys.stderr)
        return 2
    if args.xla_defaults:
        os.environ["JAXTRAIN_XLA_DEFAULTS"] = "1"
    if args.no_materialize:
        os.environ["JAXTRAIN_NO_MATERIALIZE"] = "1"
    import jaxtrain as jt

    devices = jt.setup_devices(args.devices)
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tqdm import tqdm

    from experiments.bench_torch import TorchWorker
    from jaxtrain import compat, diagnostics, models
    from jaxtrain.sharding import place
    from jaxtrain.timing import time_steps

    mesh = jt.make_mesh(devices)
    model = models.get(args.model)
    loss_fn, eval_fn = model.loss_fn, model.eval_fn
    params0, model_state0 = jax.jit(model.init)(jax.random.key(0))
    host = model.example_batch(args.batch_size)
    trainer = jt.make_train_step(loss_fn, optax.sgd(0.2), mesh=mesh)  # (a) the defaults
    trainer.check_batch_size(args.batch_size)
    state = trainer.init(params0, model_state0)
    batch = trainer.shard(host)
    cost = jt.compiled_stats(trainer, state, host, residuals=False)  # per device
    flops, bytes_accessed = cost["flops"] * len(devices), cost["bytes_accessed"] * len(devices)

    # (b) hand-written: the step anyone would write, same shardings and donation.
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(jt.DATA_AXIS))

    def sgd_step(carry, b):
        params, model_state = carry
        (loss, (model_state, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, b, None)
        return (jax.tree.map(lambda p, g: p - 0.2 * g, params, grads), model_state), {"loss": loss}

    hand = jax.jit(sgd_step, in_shardings=(replicated, sharded), out_shardings=replicated, donate_argnums=0)

    hand_carry = place((params0, model_state0), replicated)  # fresh buffers: the step donates them
    runs = {"jaxtrain": [trainer, state], "handwritten": [hand, hand_carry]}
    for run in runs.values():
        run[1], _ = time_steps(run[0], run[1], batch, 3)  # compile + warm up
    torch = TorchWorker(args.model, args.batch_size, python=args.torch_python) if use_torch else None
    times: dict[str, list[float]] = {k: [] for k in [*runs, *(["torch"] if torch else [])]}
    if torch:
        torch.time(3)  # warm-up

    def block(name: str) -> float:
        """ms/step of one timed block of ``name``, after a pause and its settle steps."""
        time.sleep(COOL_DOWN_SEC)
        if name == "torch":
            torch.time(SETTLE_STEPS)
            return 1000 * torch.time(args.steps)
        run = runs[name]
        run[1], _ = time_steps(run[0], run[1], batch, SETTLE_STEPS)
        run[1], sec = time_steps(run[0], run[1], batch, args.steps)
        return 1000 * sec

    # Interleaved and rotated (A B C, B C A, C A B, ...): with a fixed order and
    # no pause, whatever ran after PyTorch paid for its spinning threads (LeNet:
    # jaxtrain/hand-written 1.23 in one run, 1.00 without torch).
    names = list(times)
    for r in tqdm(range(args.repeats), desc="timed rounds", unit="round", disable=None, leave=False):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(block(name))
    if torch:
        torch.close()

    # (d) one epoch through the real pipeline: wall time vs steps x step time.
    from jaxtrain.data import loader, sources
    from jaxtrain.loop import fit

    train = loader.Loader(sources.load_split("fashion_mnist", "train"), args.batch_size, train=True)
    test = loader.Loader(train.split.head(args.batch_size), args.batch_size, train=False)
    evaluator = jt.make_eval_step(eval_fn, mesh=mesh)
    # The step time it is compared with is measured right around it: the machine's speed drifts.
    reference = [block("jaxtrain") for _ in range(3)]
    runs["jaxtrain"][1], history, _ = fit(trainer, runs["jaxtrain"][1], train, evaluator, test, epochs=1,
                                          max_steps=args.epoch_steps, progress=False)
    reference += [block("jaxtrain") for _ in range(3)]
    epoch = history[0]
    peak = diagnostics.measure_matmul_peak()
    med = {k: statistics.median(v) for k, v in times.items()}

    def paired(a: str, b: str) -> float:
        """Median over the repeats of a/b within each repeat (both ran within seconds of each other)."""
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(f"\n{'LeNet' if lenet_model else 'ResNet-18'} train step, batch {args.batch_size}, {len(devices)} "
          f"{devices[0].platform} devices ({compat.cpu_isa() or 'ISA unknown'}), jax {jax.__version__}"
          f"{', materialize off' if args.no_materialize else ''}; "
          f"median (min-max) of {args.repeats} x {args.steps} steps; measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s\n")
    print("| variant | ms/step | examples/s | GFLOP/s | % of peak |\n|---|---|---|---|---|")
    for name, v in times.items():
        ms = med[name]
        print(f"| {name} | {ms:.1f} ({min(v):.1f}-{max(v):.1f}) | {args.batch_size / ms * 1000:,.0f} | "
              f"{flops / ms / 1e6:.0f} | {100 * flops / ms / 1e6 / (peak / 1e9):.0f}% |")
    torch_ratio = f"{med['torch'] / med['jaxtrain']:.2f}" if "torch" in med else "n/a"
    print(f"\nratios of the medians: torch/jaxtrain {torch_ratio}, "
          f"jaxtrain/handwritten {med['jaxtrain'] / med['handwritten']:.3f}")
    paired_torch = f"{paired('torch', 'jaxtrain'):.2f}" if "torch" in med else "n/a"
    print(f"paired ratios (median of per-repeat ratios): torch/jaxtrain {paired_torch}, "
          f"jaxtrain/handwritten {paired('jaxtrain', 'handwritten'):.3f}")
    step_ms = statistics.median(reference)
    predicted = epoch.steps * step_ms / 1000
    print(f"epoch through the pipeline: {epoch.steps} steps in {epoch.train_sec:.2f} s wall vs "
          f"{predicted:.2f} s = steps x {step_ms:.1f} ms (the step timed just before and after) "
          f"({100 * (epoch.train_sec / predicted - 1):+.1f}%), data wait {100 * epoch.data_wait_fraction:.1f}%")
    print(f"compile-time cost per step: {flops / 1e9:.2f} GFLOP ({flops / args.batch_size / 1e6:.1f} MFLOP/example), "
          f"{bytes_accessed / 1e6:.0f} MB accessed -> floor here {1000 * flops / peak:.1f} ms (matmul peak); "
          f"one H100: {1e6 * flops / H100_BF16_FLOPS:.1f} us compute (bf16 790 TFLOP/s), "
          f"{1e6 * bytes_accessed / H100_BYTES_PER_S:.1f} us memory (3.0 TB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch_size": args.batch_size, "devices": len(devices),
                       "cpu_isa": compat.cpu_isa(), "jax": jax.__version__,
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "materialize": not args.no_materialize,
                       "jaxtrain_ms": med["jaxtrain"], "handwritten_ms": med["handwritten"],
                       "torch_ms": med.get("torch"), "peak_gflops": peak / 1e9, "flops_per_step": flops,
                       "bytes_per_step": bytes_accessed,
                       "epoch_wall_sec": epoch.train_sec, "epoch_predicted_sec": predicted, "epoch_reference_ms": reference,
                       "paired_torch_over_jaxtrain": paired("torch", "jaxtrain") if "torch" in med else None,
                       "paired_jaxtrain_over_handwritten": paired("jaxtrain", "handwritten"), "times_ms": times}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
