"""jaxtrain's train step vs a hand-written jax.jit step vs PyTorch, interleaved in one run.

    python -m experiments.bench [--model lenet|resnet18|gpt] [--precision fp32|bf16|int8] [--json F]
    python -m experiments.bench --model gpt [--model-size mini] [--seq-len 128] [--vocab 4096] [--unroll auto]

(a) jaxtrain's step with the defaults a user gets (make_train_step, default
strategy and devices); (b) a minimal hand-written ``jax.jit`` SGD step of the
same model on the same devices (the overhead reference); (c) PyTorch on the
CPU with ``torch.set_num_threads(cores)``, in its own process, when torch is
importable (``pip install torch==2.13.0``), and again with the malloc settings
jaxtrain's CPU runs use (``torch_same_malloc``; ``jaxtrain.parallel.host_memory``); (d) an epoch through the real input
pipeline: wall time vs steps x step time. A B C, B C A, C A B ... (rotated), warm-up excluded,
median and spread of the repeats. Batch 256 for LeNet, 64 for ResNet-18, 32 windows for the GPT.

``--model gpt`` times jaxtrain's GPT (``jaxtrain.models.gpt``: size "mini", 4 layers of width 256, 4 heads;
windows of 128 tokens, a vocabulary of 4096) against the same network in PyTorch (``bench_torch.gpt``: pre-LN
blocks, ``scaled_dot_product_attention(is_causal=True)``, GELU tanh, tied embedding padded to a multiple of 64),
every side SGD on one batch of random tokens; the table adds tokens/s (examples/s x window). No pipeline epoch (d)
for it (that one reads Fashion-MNIST).

``--precision bf16`` trains in mixed precision: jaxtrain's ``precision="bf16"``,
the hand-written step casting params and images to bf16 inside its loss,
PyTorch under ``torch.autocast("cpu", torch.bfloat16)``. ``--precision int8``
times INFERENCE on one device instead (no step builder is involved, so no
hand-written variant): jaxtrain's int8 program (``jaxtrain.analysis.quantize``, qwix)
and its fp32 one, against PyTorch's ``quantize_dynamic`` (its ``nn.Linear``
layers only) and PyTorch's fp32 forward; the weights are the initial ones
(speed does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from jaxtrain.choices import CONVS, GPT_SIZES
from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.models import LANGUAGE_MODELS
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
    p.add_argument("--model", choices=(*model_names(side=28), *LANGUAGE_MODELS), default="lenet")
    p.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="fp32 or bf16 (mixed precision) train steps, or int8 inference (one device)")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="virtual CPU devices for jaxtrain and the hand-written step (default: one per core; "
                        "PyTorch always gets every core as threads)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="global batch (default: 256 LeNet, 64 ResNet-18, 32 windows GPT)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per timed block (default: 10 LeNet, 3 ResNet-18 and GPT)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed blocks per variant (default: 40 LeNet, 10 ResNet-18 and GPT; noisy machines: more)")
    p.add_argument("--model-size", choices=GPT_SIZES, default=None,
                   help="--model gpt: its network (jaxtrain.models.gpt.SIZES; default: mini, 4 layers of width 256)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="--model gpt: tokens per window (default: the size's, 128 for mini)")
    p.add_argument("--vocab", type=positive_int, default=None,
                   help="--model gpt: vocabulary (default: the size's, 4096 for mini, GPT-2's 50257 for 124m up; "
                        "the embedding padded to a multiple of 64 on every side)")
    p.add_argument("--unroll", choices=("auto", "on", "off"), default=None,
                   help="--model gpt: its blocks laid out one after another (on) or a loop over one (off); default "
                        "auto, where measured faster (jaxtrain.models.registry.unrolled_where_faster)")
    p.add_argument("--epoch-steps", type=positive_int, default=None,
                   help="steps of the pipeline epoch (default: a full epoch for LeNet, 30 for ResNet-18)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--xla-defaults", action="store_true",
                   help="compile with XLA's default CPU flags instead of jaxtrain's (sets JAXTRAIN_XLA_DEFAULTS=1)")
    p.add_argument("--no-materialize", action="store_true",
                   help="let XLA:CPU recompute the models' stored activations (jaxtrain.core.remat.materialize off; "
                        "sets JAXTRAIN_NO_MATERIALIZE=1)")
    p.add_argument("--conv", choices=CONVS, default="auto",
                   help="jaxtrain's and the hand-written step's convolutions: auto (oneDNN's where they build), "
                        "xla, or onednn (jaxtrain.kernels.onednn)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if it is installed")
    p.add_argument("--torch-python", default=None, metavar="PYTHON",
                   help="run the PyTorch side with this interpreter (e.g. a Python 3.11 venv with torch==2.13.0 "
                        "beside a jax 0.12 one; default: this interpreter)")
    return p


@one_line_errors("bench")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    lenet_model, infer, lm = args.model == "lenet", args.precision == "int8", args.model in LANGUAGE_MODELS
    if infer and args.devices not in (None, 1):
        print("bench: error: --precision int8 times inference on one device: drop --devices", file=sys.stderr)
        return 2
    lm_flags = [f for f, v in (("--model-size", args.model_size), ("--seq-len", args.seq_len),
                               ("--vocab", args.vocab), ("--unroll", args.unroll)) if v is not None]
    if lm_flags and not lm:
        print(f"bench: error: {', '.join(lm_flags)}: a language model's ({', '.join(LANGUAGE_MODELS)}), not "
              f"{args.model}'s", file=sys.stderr)
        return 2
    args.batch_size = args.batch_size or (256 if lenet_model else 32 if lm else 64)
    args.steps = args.steps or (10 if lenet_model else 3)
    args.repeats = args.repeats or (40 if lenet_model else 10)
    args.epoch_steps = args.epoch_steps or (None if lenet_model else 30)
    from experiments import bench_torch, bench_variants

    if infer and args.model not in INT8_MODELS:
        print(f"bench: error: --precision int8 covers {', '.join(INT8_MODELS)} (jaxtrain.analysis.quantize), "
              f"not {args.model}",
              file=sys.stderr)
        return 2
    use_torch = not args.no_torch and bench_torch.available(args.torch_python)
    if use_torch and args.model not in bench_torch.MODELS:
        print(f"bench: error: the PyTorch side exists for {', '.join(bench_torch.MODELS)}: pass --no-torch for "
              f"{args.model}", file=sys.stderr)
        return 2
    if args.torch_python and not args.no_torch and not use_torch:
        print(f"bench: error: --torch-python {args.torch_python} cannot import torch", file=sys.stderr)
        return 2
    if args.xla_defaults:
        os.environ["JAXTRAIN_XLA_DEFAULTS"] = "1"
    if args.no_materialize:
        os.environ["JAXTRAIN_NO_MATERIALIZE"] = "1"
    import jaxtrain as jt

    devices = jt.setup_devices(1 if infer else args.devices)
    import jax
    from tqdm import tqdm

    from experiments.bench_torch import TorchWorker
    from jaxtrain.analysis import diagnostics
    from jaxtrain.core import compat
    from jaxtrain.parallel import host_memory
    from jaxtrain.train.timing import time_steps

    mesh = jt.make_mesh(devices)
    model = bench_variants.get_model(args, conv="xla" if infer else args.conv)  # int8: quantize's programs
    if infer:
        calls, flops = bench_variants.int8_timers(args, model)
        runs, batch, bytes_accessed = {}, None, None
    else:
        runs, batch, flops, bytes_accessed = bench_variants.train_timers(args, jt, mesh, model)
        calls = {}
        for run in runs.values():
            run[1], _ = time_steps(run[0], run[1], batch, 3)  # compile + warm up
    for fn in calls.values():
        jax.block_until_ready(fn())  # compile + warm up
    same_malloc = not infer and host_memory.applied()  # PyTorch again, with jaxtrain's malloc settings
    modes = {"torch": "int8" if infer else args.precision, **({"torch_fp32": "fp32-infer"} if infer else {}),
             **({"torch_same_malloc": args.precision} if same_malloc else {})}
    workers = {name: TorchWorker(args.model, args.batch_size, python=args.torch_python, mode=mode,
                                 env=host_memory.ENV_SETTINGS if name == "torch_same_malloc" else None,
                                 shape=bench_variants.torch_shape(model))
               for name, mode in modes.items()} if use_torch else {}
    times: dict[str, list[float]] = {k: [] for k in [*runs, *calls, *workers]}
    for worker in workers.values():
        worker.time(3)  # warm-up

    def block(name: str) -> float:
        """ms/step of one timed block of ``name``, after a pause and its settle steps."""
        time.sleep(COOL_DOWN_SEC)
        if name in workers:
            workers[name].time(SETTLE_STEPS)
            return 1000 * workers[name].time(args.steps)
        if name in calls:
            jax.block_until_ready([calls[name]() for _ in range(SETTLE_STEPS)])  # all of them done before the clock
            start = time.perf_counter()
            jax.block_until_ready([calls[name]() for _ in range(args.steps)])
            return 1000 * (time.perf_counter() - start) / args.steps
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
    for worker in workers.values():
        worker.close()
    epoch = None if infer or lm else _epoch(args, jt, mesh, runs, model.eval_fn, block)
    peak = diagnostics.devices_peak(devices, args.precision, measure=True)  # GPUs' add up; CPU devices share cores
    from jaxtrain.models.flops import TRAIN_FACTOR, forward

    # the model's FLOPs per example: 3 x forward for a train step, the forward for inference (jaxtrain.models.flops)
    model_flops = (forward(args.model, model.input_shape, model.num_classes, size=args.model_size)
                   * (1 if infer else TRAIN_FACTOR))
    med = {k: statistics.median(v) for k, v in times.items()}

    def paired(a: str, b: str) -> float | None:
        """Median over the repeats of a/b within each repeat (both ran within seconds of each other)."""
        return statistics.median(x / y for x, y in zip(times[a], times[b])) if a in times and b in times else None

    what = "int8 inference" if infer else f"{args.precision} train step"
    tokens = model.input_shape[0] if lm else None  # a language model's examples are windows of this many tokens
    convs = "" if lm else f"{model.conv} convolutions, "
    print(f"\n{bench_variants.title(args, model)} {what}, batch {args.batch_size}, {len(devices)} "
          f"{devices[0].platform} devices ({compat.cpu_isa() or 'ISA unknown'}), jax {jax.__version__}, "
          f"{convs}malloc {'keeping freed memory' if host_memory.applied() else 'as is'}"
          f"{', materialize off' if args.no_materialize else ''}; median (min-max) of {args.repeats} x {args.steps} "
          f"{'calls' if infer else 'steps'}; measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s (of all the devices: "
          "MFU and HFU are over it, whatever the precision)\n")
    columns = ["ms/step", "examples/s", *(["tokens/s"] if lm else []), "GFLOP/s (compiled)", "MFU", "HFU"]
    print(f"| variant | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for name, v in times.items():
        ms = med[name]
        per_s = args.batch_size / ms * 1000
        cells = [f"{ms:.1f} ({min(v):.1f}-{max(v):.1f})", f"{per_s:,.0f}", *([f"{per_s * tokens:,.0f}"] if lm else []),
                 f"{flops / ms / 1e6:.0f}", f"{model_flops * args.batch_size / ms / 1e-3 / peak:.0%}",
                 f"{flops / ms / 1e-3 / peak:.0%}"]
        print(f"| {name} | {' | '.join(cells)} |")
    ratios = {"torch/jaxtrain": paired("torch", "jaxtrain"), "jaxtrain/handwritten": paired("jaxtrain", "handwritten"),
              "torch_same_malloc/jaxtrain": paired("torch_same_malloc", "jaxtrain"),
              "jaxtrain int8/fp32": paired("jaxtrain", "jaxtrain_fp32"),
              "torch int8/fp32": paired("torch", "torch_fp32"),
              "fp32 torch/jaxtrain": paired("torch_fp32", "jaxtrain_fp32")}
    print("\npaired ratios (median of per-repeat ratios of ms/step: above 1, the second is faster): " +
          ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in ratios.items() if k in RATIOS[infer]))
    if epoch:
        print(epoch["line"])
    if flops < model_flops * args.batch_size:  # XLA's cost analysis counts a while loop's body once
        print(f"note: the compiled program's FLOPs ({flops / 1e9:.2f} G) are below the model's "
              f"({model_flops * args.batch_size / 1e9:.2f} G): XLA counts a loop's body once (a scan over layers): "
              "its GFLOP/s, HFU and floor undercount")
    print(f"compile-time cost per {'call' if infer else 'step'}: {flops / 1e9:.2f} GFLOP "
          f"({flops / args.batch_size / 1e6:.1f} MFLOP/example)"
          + ("" if infer else f", {bytes_accessed / 1e6:.0f} MB accessed")
          + f" -> floor here {1000 * flops / peak:.1f} ms (matmul peak); "
          f"one H100: {1e6 * flops / H100_BF16_FLOPS:.1f} us compute (bf16 790 TFLOP/s)"
          + ("" if infer else f", {1e6 * bytes_accessed / H100_BYTES_PER_S:.1f} us memory (3.0 TB/s)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "precision": args.precision, "batch_size": args.batch_size,
                       "devices": len(devices), "cpu_isa": compat.cpu_isa(), "jax": jax.__version__,
                       "conv": model.conv, "malloc_kept": host_memory.applied(),
                       **(bench_variants.lm_fields(args, model, med) if lm else {}),
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "materialize": not args.no_materialize,
                       **{f"{k}_ms": med.get(k) for k in ("jaxtrain", "handwritten", "torch", "jaxtrain_fp32",
                                                          "torch_fp32", "torch_same_malloc")},
                       "peak_gflops": peak / 1e9, "flops_per_step": flops, "bytes_per_step": bytes_accessed,
                       "model_flops_per_example": model_flops,  # 3 x forward (train) or the forward (inference)
                       "jaxtrain_mfu": model_flops * args.batch_size / (med["jaxtrain"] * 1e-3) / peak,
                       "jaxtrain_hfu": flops / (med["jaxtrain"] * 1e-3) / peak,
                       **({k: v for k, v in epoch.items() if k != "line"} if epoch else {}),
                       "paired_torch_over_jaxtrain": ratios["torch/jaxtrain"],
                       "paired_jaxtrain_over_handwritten": ratios["jaxtrain/handwritten"],
                       "paired_torch_same_malloc_over_jaxtrain": ratios["torch_same_malloc/jaxtrain"],
                       "paired_int8_over_fp32": ratios["jaxtrain int8/fp32"],
                       "paired_torch_int8_over_fp32": ratios["torch int8/fp32"],
                       "paired_fp32_torch_over_jaxtrain": ratios["fp32 torch/jaxtrain"], "times_ms": times},
                      f, indent=2)
    return 0


INT8_MODELS = ("lenet", "resnet18")  # jaxtrain.analysis.quantize.MODELS, without importing JAX before the flags are set

# the ratios printed for training (False) and for int8 inference (True)
RATIOS = {False: ("torch/jaxtrain", "torch_same_malloc/jaxtrain", "jaxtrain/handwritten"),
          True: ("torch/jaxtrain", "jaxtrain int8/fp32", "torch int8/fp32", "fp32 torch/jaxtrain")}


def _epoch(args, jt, mesh, runs, eval_fn, block) -> dict:
    """(d) one epoch of jaxtrain's step through the real pipeline: wall time vs steps x step time."""
    from jaxtrain.data import loader, sources
    from jaxtrain.train.loop import fit

    train = loader.Loader(sources.load_split("fashion_mnist", "train"), args.batch_size, train=True)
    test = loader.Loader(train.split.head(args.batch_size), args.batch_size, train=False)
    evaluator = jt.make_eval_step(eval_fn, mesh=mesh)
    # The step time it is compared with is measured right around it: the machine's speed drifts.
    reference = [block("jaxtrain") for _ in range(3)]
    runs["jaxtrain"][1], history, _ = fit(runs["jaxtrain"][0], runs["jaxtrain"][1], train, evaluator, test, epochs=1,
                                          max_steps=args.epoch_steps, progress=False)
    reference += [block("jaxtrain") for _ in range(3)]
    epoch, step_ms = history[0], statistics.median(reference)
    predicted = epoch.steps * step_ms / 1000
    line = (f"epoch through the pipeline: {epoch.steps} steps in {epoch.train_sec:.2f} s wall vs "
            f"{predicted:.2f} s = steps x {step_ms:.1f} ms (the step timed just before and after) "
            f"({100 * (epoch.train_sec / predicted - 1):+.1f}%), data wait {100 * epoch.data_wait_fraction:.1f}%")
    return {"line": line, "epoch_wall_sec": epoch.train_sec, "epoch_predicted_sec": predicted,
            "epoch_reference_ms": reference}


if __name__ == "__main__":
    sys.exit(main())
