"""jaxtrain's train step vs a hand-written jax.jit step vs PyTorch, interleaved in one run.

    python -m experiments.bench [--model lenet|resnet18|gpt] [--precision fp32|bf16|int8] [--json F]
    python -m experiments.bench --model gpt [--model-size mini] [--seq-len 128] [--vocab 4096] [--unroll auto]
                                            [--rotary]

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
import os
import sys

from experiments import bench_variants, harness
from jaxtrain.choices import CONVS, GPT_SIZES
from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.errors import ConfigError
from jaxtrain.models import LANGUAGE_MODELS
from jaxtrain.models import names as model_names

# Worker threads (XLA's, PyTorch's OpenMP) keep spinning for a while after a step and steal the cores from
# whatever runs next. So every timed block starts with a pause (the previous variant's threads go to sleep), then
# a few untimed steps of its own (its threads wake up), and the blocks rotate (A B C, B C A, C A B, ...): with a
# fixed order and no pause, whatever ran after PyTorch paid for its spinning threads (LeNet: jaxtrain/hand-written
# 1.23 in one run, 1.00 without torch).
TURNS = {"rotate": True, "pause": 0.3, "settle": 3}

# What one H100 sustains in practice (measured figures quoted in issue 9, not
# datasheet peaks): dense bf16 matmul FLOP/s and HBM bytes/s.
H100_BF16_FLOPS, H100_BYTES_PER_S = 790e12, 3.0e12

INT8_MODELS = ("lenet", "resnet18")  # jaxtrain.analysis.quantize.MODELS, without importing JAX before the flags are set

# The paired ratios (harness.paired): as printed -> (variant over variant, the JSON's key); printed for training
# (False) and for int8 inference (True)
PAIRS = {"torch/jaxtrain": ("torch", "jaxtrain", "paired_torch_over_jaxtrain"),
         "jaxtrain/handwritten": ("jaxtrain", "handwritten", "paired_jaxtrain_over_handwritten"),
         "torch_same_malloc/jaxtrain": ("torch_same_malloc", "jaxtrain", "paired_torch_same_malloc_over_jaxtrain"),
         "jaxtrain int8/fp32": ("jaxtrain", "jaxtrain_fp32", "paired_int8_over_fp32"),
         "torch int8/fp32": ("torch", "torch_fp32", "paired_torch_int8_over_fp32"),
         "fp32 torch/jaxtrain": ("torch_fp32", "jaxtrain_fp32", "paired_fp32_torch_over_jaxtrain")}
RATIOS = {False: ("torch/jaxtrain", "jaxtrain/handwritten", "torch_same_malloc/jaxtrain"),
          True: ("torch/jaxtrain", "jaxtrain int8/fp32", "torch int8/fp32", "fp32 torch/jaxtrain")}
VARIANTS = ("jaxtrain", "handwritten", "torch", "jaxtrain_fp32", "torch_fp32", "torch_same_malloc")  # JSON: NAME_ms


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench", __doc__, steps=None, repeats=None)  # --steps here: its default, as --repeats', by model
    p.add_argument("--steps", type=positive_int, default=None,
                   help="steps per timed block (default: 10 LeNet, 3 ResNet-18 and GPT; --repeats: 40 LeNet, "
                        "10 ResNet-18 and GPT; noisy machines: more)")
    p.add_argument("--model", choices=(*model_names(side=28), *LANGUAGE_MODELS), default="lenet")
    p.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="fp32 or bf16 (mixed precision) train steps, or int8 inference (one device)")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="virtual CPU devices for jaxtrain and the hand-written step (default: one per core; "
                        "PyTorch always gets every core as threads)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="global batch (default: 256 LeNet, 64 ResNet-18, 32 windows GPT)")
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
    p.add_argument("--rotary", action="store_true", default=None,
                   help="--model gpt: rotary positions (jaxtrain's and PyTorch's GPT alike), not learned ones")
    p.add_argument("--epoch-steps", type=positive_int, default=None,
                   help="steps of the pipeline epoch (default: a full epoch for LeNet, 30 for ResNet-18)")
    p.add_argument("--xla-defaults", action="store_true",
                   help="compile with XLA's default CPU flags instead of jaxtrain's (sets JAXTRAIN_XLA_DEFAULTS=1)")
    p.add_argument("--no-materialize", action="store_true",
                   help="let XLA:CPU recompute the models' stored activations (jaxtrain.core.remat.materialize off; "
                        "sets JAXTRAIN_NO_MATERIALIZE=1)")
    p.add_argument("--conv", choices=CONVS, default="auto",
                   help="jaxtrain's and the hand-written step's convolutions, and a GPT's attention products: auto "
                        "(oneDNN's where they build), xla, or onednn (jaxtrain.kernels.onednn)")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if it is installed")
    p.add_argument("--torch-python", default=None, metavar="PYTHON",
                   help="run the PyTorch side with this interpreter (e.g. a Python 3.11 venv with torch==2.13.0 "
                        "beside a jax 0.12 one; default: this interpreter)")
    return p


@one_line_errors("bench")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    use_torch = prepare(args)
    import jaxtrain as jt

    infer = args.precision == "int8"
    devices = jt.setup_devices(1 if infer else args.devices)
    mesh = jt.make_mesh(devices)
    model = bench_variants.get_model(args, conv="xla" if infer else args.conv)  # int8: quantize's programs
    runs, flops, bytes_accessed = (bench_variants.int8_timers(args, model) if infer else
                                   bench_variants.train_timers(args, jt, mesh, model))
    workers = bench_variants.torch_timers(args, model) if use_torch else {}
    runs |= workers
    for run in runs.values():
        harness.warm_up(run, 3)  # compile + warm up
    harness.progress(f"timing {', '.join(runs)}: {args.repeats} x {args.steps} steps each")
    harness.interleave(runs.values(), args.steps, args.repeats, bar="timed rounds", **TURNS)
    for worker in workers.values():
        worker.step.close()
    epoch = None if infer or args.model in LANGUAGE_MODELS else _epoch(args, jt, mesh, runs["jaxtrain"], model.eval_fn)
    result = figures(args, model, devices, runs, flops, bytes_accessed, epoch)
    print(report(args, model, devices, runs, result, epoch))
    harness.write_json(args.json, result)
    return 0


def prepare(args) -> bool:
    """Refuse what cannot run (a ConfigError: one line), fill in the model's defaults and set the environment's flags,
    before JAX starts; whether PyTorch runs."""
    from experiments import bench_torch

    lenet_model, infer, lm = args.model == "lenet", args.precision == "int8", args.model in LANGUAGE_MODELS
    if infer and args.devices not in (None, 1):
        raise ConfigError("--precision int8 times inference on one device: drop --devices")
    lm_flags = [f for f, v in (("--model-size", args.model_size), ("--seq-len", args.seq_len),
                               ("--vocab", args.vocab), ("--unroll", args.unroll), ("--rotary", args.rotary))
                if v is not None]
    if lm_flags and not lm:
        raise ConfigError(f"{', '.join(lm_flags)}: a language model's ({', '.join(LANGUAGE_MODELS)}), not "
                          f"{args.model}'s")
    if infer and args.model not in INT8_MODELS:
        raise ConfigError(f"--precision int8 covers {', '.join(INT8_MODELS)} (jaxtrain.analysis.quantize), "
                          f"not {args.model}")
    use_torch = not args.no_torch and bench_torch.available(args.torch_python)
    if use_torch and args.model not in bench_torch.MODELS:
        raise ConfigError(f"the PyTorch side exists for {', '.join(bench_torch.MODELS)}: pass --no-torch for "
                          f"{args.model}")
    if args.torch_python and not args.no_torch and not use_torch:
        raise ConfigError(f"--torch-python {args.torch_python} cannot import torch")
    args.batch_size = args.batch_size or (256 if lenet_model else 32 if lm else 64)
    args.steps = args.steps or (10 if lenet_model else 3)
    args.repeats = args.repeats or (40 if lenet_model else 10)
    args.epoch_steps = args.epoch_steps or (None if lenet_model else 30)
    if args.xla_defaults:
        os.environ["JAXTRAIN_XLA_DEFAULTS"] = "1"
    if args.no_materialize:
        os.environ["JAXTRAIN_NO_MATERIALIZE"] = "1"
    return use_torch


def _epoch(args, jt, mesh, run: harness.Timed, eval_fn) -> dict:
    """(d) one epoch of jaxtrain's step (``run``) through the real pipeline: wall time vs steps x step time."""
    from jaxtrain.data import loader, sources
    from jaxtrain.train.loop import fit

    train = loader.Loader(sources.load_split("fashion_mnist", "train"), args.batch_size, train=True)
    test = loader.Loader(train.split.head(args.batch_size), args.batch_size, train=False)
    evaluator = jt.make_eval_step(eval_fn, mesh=mesh)
    # The step time it is compared with is measured right around it (3 blocks before, 3 after): the machine's
    # speed drifts.
    reference = harness.Timed(run.step, run.state, run.batch)
    harness.interleave([reference], args.steps, 3, **TURNS)
    reference.state, history, _ = fit(reference.step, reference.state, train, evaluator, test, epochs=1,
                                      max_steps=args.epoch_steps, progress=False)
    harness.interleave([reference], args.steps, 3, **TURNS)
    epoch, step_ms = history[0], reference.median
    predicted = epoch.steps * step_ms / 1000
    line = (f"epoch through the pipeline: {epoch.steps} steps in {epoch.train_sec:.2f} s wall vs "
            f"{predicted:.2f} s = steps x {step_ms:.1f} ms (the step timed just before and after) "
            f"({100 * (epoch.train_sec / predicted - 1):+.1f}%), data wait {100 * epoch.data_wait_fraction:.1f}%")
    return {"line": line, "epoch_wall_sec": epoch.train_sec, "epoch_predicted_sec": predicted,
            "epoch_reference_ms": reference.ms}


def figures(args, model, devices, runs: dict, flops: float, bytes_accessed: float | None, epoch: dict | None) -> dict:
    """The JSON: the setting, each variant's median ms/step, the step's cost, MFU and HFU, the paired ratios."""
    import jax

    from jaxtrain.analysis import diagnostics
    from jaxtrain.core import compat
    from jaxtrain.models.flops import TRAIN_FACTOR, forward
    from jaxtrain.parallel import host_memory

    peak = diagnostics.devices_peak(devices, args.precision, measure=True)  # GPUs' add up; CPU devices share cores
    # the model's FLOPs per example: 3 x forward for a train step, the forward for inference (jaxtrain.models.flops)
    model_flops = (forward(args.model, model.input_shape, model.num_classes, size=args.model_size)
                   * (1 if args.precision == "int8" else TRAIN_FACTOR))
    med = {name: run.median for name, run in runs.items()}
    return {"model": args.model, "precision": args.precision, "batch_size": args.batch_size,
            "devices": len(devices), "cpu_isa": compat.cpu_isa(), "jax": jax.__version__,
            "conv": model.conv, "malloc_kept": host_memory.applied(),
            "attention": getattr(getattr(model, "config", None), "attention", None),  # a GPT's (gpt.Config)
            **(bench_variants.lm_fields(args, model, med) if args.model in LANGUAGE_MODELS else {}),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "materialize": not args.no_materialize,
            **{f"{name}_ms": med.get(name) for name in VARIANTS},
            "peak_gflops": peak / 1e9, "flops_per_step": flops, "bytes_per_step": bytes_accessed,
            "model_flops_per_example": model_flops,  # 3 x forward (train) or the forward (inference)
            "jaxtrain_mfu": model_flops * args.batch_size / (med["jaxtrain"] * 1e-3) / peak,
            "jaxtrain_hfu": flops / (med["jaxtrain"] * 1e-3) / peak,
            **({k: v for k, v in epoch.items() if k != "line"} if epoch else {}),
            **{key: harness.paired(runs[a], runs[b]) if a in runs and b in runs else None
               for a, b, key in PAIRS.values()},
            "times_ms": {name: run.ms for name, run in runs.items()}}


def report(args, model, devices, runs: dict, r: dict, epoch: dict | None) -> str:
    """The heading, a row per variant, the paired ratios and the step's compile-time cost (``r``: ``figures``)."""
    infer, lm = args.precision == "int8", args.model in LANGUAGE_MODELS
    flops, bytes_accessed, model_flops = r["flops_per_step"], r["bytes_per_step"], r["model_flops_per_example"]
    peak, batch = r["peak_gflops"] * 1e9, args.batch_size
    tokens = model.input_shape[0] if lm else None  # a language model's examples are windows of this many tokens
    columns = ["ms/step", "examples/s", *(["tokens/s"] if lm else []), "GFLOP/s (compiled)", "MFU", "HFU"]
    lines = ["", heading(args, model, devices, r), "", f"| variant | {' | '.join(columns)} |",
             f"|---|{'---|' * len(columns)}"]
    for name, run in runs.items():
        ms, per_s = run.median, batch / run.median * 1000
        cells = [harness.spread(run.ms), f"{per_s:,.0f}", *([f"{per_s * tokens:,.0f}"] if lm else []),
                 f"{flops / ms / 1e6:.0f}", f"{model_flops * batch / ms / 1e-3 / peak:.0%}",
                 f"{flops / ms / 1e-3 / peak:.0%}"]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    ratios = {k: r[PAIRS[k][2]] for k in RATIOS[infer]}
    lines += ["", "paired ratios (median of per-repeat ratios of ms/step: above 1, the second is faster): " +
              ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in ratios.items())]
    if epoch:
        lines.append(epoch["line"])
    if flops < model_flops * batch:  # XLA's cost analysis counts a while loop's body once
        lines.append(f"note: the compiled program's FLOPs ({flops / 1e9:.2f} G) are below the model's "
                     f"({model_flops * batch / 1e9:.2f} G): XLA counts a loop's body once (a scan over layers): "
                     "its GFLOP/s, HFU and floor undercount")
    lines.append(f"compile-time cost per {'call' if infer else 'step'}: {flops / 1e9:.2f} GFLOP "
                 f"({flops / batch / 1e6:.1f} MFLOP/example)"
                 + ("" if infer else f", {bytes_accessed / 1e6:.0f} MB accessed")
                 + f" -> floor here {1000 * flops / peak:.1f} ms (matmul peak); "
                 f"one H100: {1e6 * flops / H100_BF16_FLOPS:.1f} us compute (bf16 790 TFLOP/s)"
                 + ("" if infer else f", {1e6 * bytes_accessed / H100_BYTES_PER_S:.1f} us memory (3.0 TB/s)"))
    return "\n".join(lines)


def heading(args, model, devices, r: dict) -> str:
    """What was timed, on what, and how (``r``: ``figures``)."""
    infer, lm = args.precision == "int8", args.model in LANGUAGE_MODELS
    what = "int8 inference" if infer else f"{args.precision} train step"
    convs = "" if lm else f"{model.conv} convolutions, "
    return (f"{bench_variants.title(args, model)} {what}, batch {args.batch_size}, {len(devices)} "
            f"{devices[0].platform} devices ({r['cpu_isa'] or 'ISA unknown'}), jax {r['jax']}, "
            f"{convs}malloc {'keeping freed memory' if r['malloc_kept'] else 'as is'}"
            f"{', materialize off' if args.no_materialize else ''}; median (min-max) of {args.repeats} x "
            f"{args.steps} {'calls' if infer else 'steps'}; measured fp32 matmul peak {r['peak_gflops']:.0f} GFLOP/s "
            "(of all the devices: MFU and HFU are over it, whatever the precision)")


if __name__ == "__main__":
    sys.exit(main())
