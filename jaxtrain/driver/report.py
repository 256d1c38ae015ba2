"""What a run says about itself: its first line (``describe``), its summary.json (``run_summary``), and why a run
that does not learn does not."""

from __future__ import annotations

import statistics
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxtrain import settings
from jaxtrain.core.compat import command_buffers_said, cpu_isa
from jaxtrain.errors import named
from jaxtrain.models import LANGUAGE_MODELS, VIT_CONFIGS, LanguageModel, Model
from jaxtrain.parallel import devices as devices_lib
from jaxtrain.driver.config import RunConfig


def timed_epochs(history: list) -> list:
    """The epochs the steady-state speed is read from: all but the first (its programs' first runs; their
    compiles are off every epoch's clock: ``compile_sec``), where there are others."""
    return history[1:] if len(history) > 1 else history


def projected_words(history: list, steps_per_epoch: int) -> str:
    """" (projected from N steps)" where a timed epoch was cut short (``--max-steps``): the sec/epoch said is its
    rate, not an epoch timed; "" otherwise."""
    timed = timed_epochs(history)
    steps = sum(e.steps for e in timed)
    return (f" (projected from {steps} step{'s' * (steps != 1)})"
            if any(e.steps < steps_per_epoch for e in timed) else "")


def run_summary(args, model, history, first_loss, stats, peak, devices, call_batch: int, steps_per_epoch: int,
                examples: dict, data_sha256: str) -> dict:
    """summary.json of a finished run: results, steady-state speed, compiled costs, settings; the MFU from
    ``model``'s forward FLOPs per example (``jaxtrain.models.flops``), the HFU from the compiled FLOPs."""
    from jaxtrain.models.flops import utilisation

    timed = timed_epochs(history)
    examples_per_sec = sum(h.examples for h in timed) / max(sum(h.train_sec for h in timed), 1e-9)
    wait = sum(h.data_wait_sec for h in timed) / max(sum(h.train_sec for h in timed), 1e-9)
    achieved_flops = stats["flops"] * len(devices) * examples_per_sec / call_batch
    model_flops = forward_flops(args, model)
    use = utilisation(model_flops, stats["flops"] * len(devices), call_batch, call_batch / examples_per_sec, peak)
    last = history[-1]
    return {
        "experiment": args.model,
        "test_acc": last.test_acc,
        "test_loss": last.test_loss,
        "train_loss": last.train_loss,
        "train_acc": last.train_acc,
        "initial_loss": first_loss,
        "sec_per_epoch": steps_per_epoch * call_batch / examples_per_sec,
        "ms_per_update": 1000 * args.batch_size / examples_per_sec,
        "first_epoch_sec": history[0].train_sec + history[0].compile_sec,  # its compiles too
        "median_epoch_sec": statistics.median(h.train_sec for h in history),
        "examples_per_sec": examples_per_sec,
        "data_wait_fraction": wait,
        "bottleneck": bottleneck(wait),  # which side set the pace: "input pipeline" or "step"
        "workers": args.workers,
        "prefetch": args.prefetch,
        "devices": len(devices),
        "processes": jax.process_count(),
        "platform": devices[0].platform,
        "cpu_isa": cpu_isa() if devices[0].platform == "cpu" else None,  # CPU results depend on it
        "strategy": args.strategy,
        "precision": args.precision,
        "accum_steps": args.accum_steps,
        "accum": args.accum,
        "remat": args.remat,
        "compiled_flops": stats["flops"],  # per device
        "ms_per_step": 1000 * call_batch / examples_per_sec,
        "achieved_flops_per_sec": achieved_flops,
        "peak_flops_per_sec": peak,  # of all the devices together: GPUs' peaks add up; CPU devices share the cores
        "model_flops_per_example": model_flops,  # forward, from the layers' shapes (jaxtrain.models.flops)
        # MFU: 3 x model FLOPs per example x examples/s over the devices' dense peak; HFU: the compiled program's
        # FLOPs instead (remat's recomputation included). None where the peak is not known (CPUs: --measure-peak).
        "mfu": use["mfu"],
        "hfu": use["hfu"],
        "compiled_temp_bytes": stats["temp_bytes"],
        "saved_residual_bytes": stats["saved_residual_bytes"],
        "steps": sum(h.steps for h in history),
        "epochs": len(history),
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "dataset": args.dataset,
        "data_source": args.data_dir or "default",
        "data_sha256": data_sha256,
        "train_examples": examples["train"],
        "test_examples": last.test_examples,
        "jax_version": jax.__version__,
    }


INPUT_BOUND = 0.05  # a data wait above this share of the train time: the input pipeline sets the pace


def bottleneck(wait_fraction: float) -> str:
    """Which side set a run's pace: "input pipeline" (its steps waited for batches more than INPUT_BOUND of the
    time) or "step"."""
    return "input pipeline" if wait_fraction > INPUT_BOUND else "step"


def wait_words(wait_fraction: float, workers: int) -> str:
    """The data wait of an epoch's line, and where it is large, what to do: "data wait 31.0% (the input pipeline
    is the bottleneck: ...)"."""
    words = f"data wait {100 * wait_fraction:.1f}%"
    if bottleneck(wait_fraction) == "step":
        return words
    return (f"{words} (the input pipeline is the bottleneck, not the step: {workers} worker(s); more --workers, up "
            f"to the cores, or --prefetch; experiments.input_pipeline measures the loader alone)")


def forward_flops(c: RunConfig, model: Model) -> float | None:
    """The model's forward FLOPs per example, from its layers' shapes (``jaxtrain.models.flops``): the MFU's."""
    from jaxtrain.models.flops import forward

    return forward(c.model, model.input_shape, model.num_classes, c.model_size)


def utilisation_words(summary: dict) -> str:
    """", MFU 15.7%, HFU 15.2%" for a run's last line: what of them is known (GPUs, or --measure-peak)."""
    return "".join(f", {k.upper()} {summary[k]:.1%}" for k in ("mfu", "hfu") if summary[k] is not None)


def describe(c: RunConfig, model: Model, devices: list[jax.Device], mesh: Mesh, layout: dict, pipeline: dict | None,
             data: dict, out_dir: Path | None) -> str:
    """The run's first line: model, data, devices, placement, precision, ... ``layout``: the state's
    (``integrity.state_layout``: "sharded" and "replicated" parameters); ``pipeline``: a pipelined trainer's
    ``describe()``, or None."""
    sharded = len(layout["sharded"])
    placement = "layers over the stages" if pipeline else c.param_sharding
    return (f"{c.model}: {len(data['train'])} train / {len(data['test'])} test {shape_words(c, model)}, batch "
            f"{c.batch_size} on {len(devices)} {devices[0].platform} device(s), strategy {c.strategy}, mesh "
            f"{','.join(f'{k}={v}' for k, v in mesh.shape.items())}, {placement} ({sharded} of "
            f"{sharded + len(layout['replicated'])} parameters sharded), {c.precision}, accum {c.accum_steps} "
            f"({c.accum}), remat {c.remat}, {c.optimizer} lr {c.lr:g} ({c.schedule})"
            + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "")
            + (", quantisation-aware int8" if c.quantize == "int8" else "")
            + (", Pallas cross-entropy kernel" if c.kernels == "pallas" else "")
            + f", conv: {conv_path(c, model, devices[0].platform)}"
            + (f", command buffers: {command_buffers_said(settings.xla_flags())}"
               if devices[0].platform == "gpu" else "")
            + (f", XLA flags added: {' '.join(devices_lib.xla_flags_added())}" if devices_lib.xla_flags_added() else "")
            + (f", distilled from {c.teacher} (T {c.temperature:g}, alpha {c.alpha:g})" if c.teacher else "")
            + (", pipeline {stages} stages x {microbatches} micro-batches ({schedule}, repeats {repeats}, bubble "
               "{bubble:.0%})".format(**pipeline) if pipeline else "")
            + (f"; out: {out_dir}" if out_dir is not None else "; no files written"))


def shape_words(c: RunConfig, model: Model) -> str:
    """What a run's examples are: "examples of fashion_mnist (28x28x1, 10 classes)", or a language model's "windows
    of text:PATH (128 tokens, vocabulary 4096 (bpe), model size mini, positions: learned, attention: XLA's, blocks:
    unrolled)"."""
    if isinstance(model, LanguageModel):
        return (f"windows of {c.dataset} ({model.seq_len} tokens, vocabulary {model.num_classes} ({c.tokenizer}), "
                f"model size {c.model_size}, positions: {'rotary' if model.config.rotary else 'learned'}, "
                f"attention: {attention_words(jax.devices()[0], c.precision, model.config.attention)}, blocks: "
                f"{'unrolled' if model.config.unroll else 'a loop'})")
    return f"examples of {c.dataset} ({'x'.join(map(str, model.input_shape))}, {model.num_classes} classes)"


def attention_words(device, precision: str, choice: str = "auto") -> str:
    """Whose attention the GPT runs (``gpt.attention_implementation``'s rule): cuDNN's fused kernel in bf16 and
    fp16 on a GPU that runs it (``gpt.fused_attention``); in fp32 on a CPU, with ``choice`` (its
    ``gpt.Config.attention``) "onednn", XLA's with oneDNN's products; XLA's otherwise (and why, on a GPU that does
    not)."""
    from jaxtrain.models.gpt import fused_attention

    if precision not in ("bf16", "fp16"):
        return "XLA's, its products oneDNN's" if choice == "onednn" and precision == "fp32" else "XLA's"
    if choice == "onednn" and device.platform == "cpu":  # chosen, and not taken: said why
        return f"XLA's ({named('precision', precision)}: oneDNN's products are fp32's)"
    why = fused_attention(device)
    return "cuDNN's fused kernel" if why is None else "XLA's" + (f" ({why})" if device.platform == "gpu" else "")


def conv_path(c, model, platform: str) -> str:
    """Which convolutions the run's model takes, and why (``jaxtrain.kernels.onednn.path``): its first line and
    summary.json say it. ``c``: the RunConfig."""
    from jaxtrain.kernels import onednn

    if model.conv == "xla" and c.conv != "xla" and platform == "cpu":
        if c.quantize != "none":
            return f"xla ({named('quantize', c.quantize)}: its layers' own convolutions)"
        if model.name in VIT_CONFIGS or model.name in LANGUAGE_MODELS:
            return f"none ({model.name} has no convolutions)"
    if model.conv == "onednn" and c.precision != "fp32" and platform == "cpu":  # every convolution in bf16 / fp16
        return f"xla ({named('precision', c.precision)}: oneDNN's convolutions are fp32's)"
    return onednn.path(c.conv, model.conv, platform)


def not_learning(history, first_loss: float, num_classes: int) -> str:
    """A note for the result line when the run has not learned: test accuracy within 0.02 of guessing, and the
    training loss not below 95% of the first step's."""
    chance = 1 / num_classes
    if history[-1].test_acc > chance + 0.02 or not history[-1].train_loss >= 0.95 * first_loss:
        return ""
    return (f"; at chance ({chance:.2f}) and the loss did not fall: not learning (more {named('epochs', '?')} "
            f"another {named('lr', '?')})")
