"""The experiments' command-line flags (argparse), each with a one-line error for bad input."""

from __future__ import annotations

import argparse

from jaxtrain.errors import ConfigError


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a one-line error otherwise)."""
    return _whole_number(text, 1)


def _non_negative_int(text: str) -> int:
    return _whole_number(text, 0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def make_parser(prog: str, description: str, *, epochs: int, batch_size: int, lr: float) -> argparse.ArgumentParser:
    from jaxtrain.data.sources import DATASETS, DEFAULT_IDX_DIRS
    from jaxtrain.parallel import STRATEGIES
    from jaxtrain.sharding import PRESETS

    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=positive_int, default=None,
                   help="devices to train on: on CPU this many virtual devices sharing the cores "
                        "(default: one per core), on GPU the first N GPUs (default: all)")
    p.add_argument("--devices-per-process", type=positive_int, default=None,
                   help="multi-process runs: CPU virtual devices per process (python -m jaxtrain.launch sets it)")
    p.add_argument("--coordinator", default=None,
                   help="multi-process runs without the launcher: HOST:PORT of process 0's coordinator")
    p.add_argument("--num-processes", type=positive_int, default=None, help="multi-process runs: process count")
    p.add_argument("--process-id", type=int, default=None, help="multi-process runs: this process's id (0..N-1)")
    p.add_argument("--strategy", choices=STRATEGIES, default="jit",
                   help="parallel strategy: jit (XLA inserts the collectives), shard_map (explicit pmean; all-gather "
                        "and reduce-scatter under fsdp), pmap (legacy API, replicated only), ring (our ppermute ring)")
    p.add_argument("--param-sharding", choices=PRESETS, default="replicated",
                   help="where parameters and optimizer state live: replicated (data parallelism), fsdp (sharded "
                        "over the data axis, ZeRO-3), tp (the model's tensor-parallel rules over the 'model' axis; "
                        "jit only), fsdp+tp (both, on a 2-D --mesh)")
    p.add_argument("--mesh", type=_mesh, default=None, metavar="data=N[,model=M]",
                   help="named mesh axes, their product = --devices (default: data over every device); "
                        "the batch is split over 'data' and replicated over 'model'")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="compute dtype (fp32 master params either way); fp16 uses a dynamic loss scale")
    p.add_argument("--accum-steps", type=positive_int, default=1,
                   help="gradient accumulation: micro-batches per optimizer update")
    p.add_argument("--accum", choices=("scan", "multisteps"), default="scan",
                   help="scan: one call = one update over k micro-batches (one all-reduce); "
                        "multisteps: optax.MultiSteps, one call per micro-batch, an update every k calls")
    p.add_argument("--remat", default="none",
                   help="remat policy per block: none, full, dots, dots_no_batch, or a jax.checkpoint_policies name")
    p.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=batch_size,
                   help="GLOBAL batch per optimizer update, split evenly over the devices (and micro-batches)")
    p.add_argument("--lr", type=_positive_float, default=lr, help="learning rate of plain SGD")
    p.add_argument("--seed", type=int, default=0, help="seed of the init and of the shuffling")
    p.add_argument("--dataset", choices=DATASETS, default="fashion_mnist", help="dataset to train on")
    p.add_argument("--data-dir", default=None,
                   help="directory holding the four IDX files (train-images-idx3-ubyte[.gz], ...); "
                        f"default for fashion_mnist: {DEFAULT_IDX_DIRS['fashion_mnist']} (Debian package)")
    p.add_argument("--tfds-dir", default=None,
                   help="TFDS data dir where the converted dataset is cached (default: $TFDS_DATA_DIR "
                        "or ~/tensorflow_datasets)")
    p.add_argument("--out", default=None,
                   help="output directory for metrics.jsonl, summary.json and curves.png "
                        "(default: a fresh runs/NAME-DATE-TIME)")
    p.add_argument("--workers", type=_non_negative_int, default=0,
                   help="grain worker threads building batches ahead (0: in the prefetch thread; see README)")
    p.add_argument("--prefetch", type=_non_negative_int, default=2,
                   help="batches copied to the devices ahead of the step by a background thread (0: off)")
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this many train steps in total (for smoke runs), then evaluate")
    p.add_argument("--memory-report", action="store_true",
                   help="print host and device memory at the start and after the first step")
    p.add_argument("--summary", action="store_true",
                   help="print the model summary (parameters per layer, bytes, FLOPs per example) before training")
    p.add_argument("--measure-peak", action="store_true",
                   help="measure this device's fp32 matmul peak once, for the MFU in summary.json "
                        "(GPUs use datasheet peaks without it)")
    p.add_argument("--train-subset", type=positive_int, default=None,
                   help="train on the first N training examples only (CPU-sized runs); the test set stays whole")
    p.add_argument("--test-subset", type=positive_int, default=None,
                   help="evaluate on the first N test examples only (smoke runs); default: every test example")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save orbax checkpoints (TrainState + data position) here, at every epoch end")
    p.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="also checkpoint every N train steps")
    p.add_argument("--keep-checkpoints", type=positive_int, default=3, help="keep the newest K checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="continue exactly where the newest readable checkpoint in --checkpoint-dir stopped")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (they show only on a terminal anyway)")
    return p


def _mesh(text: str) -> dict[str, int]:
    from jaxtrain.devices import parse_mesh

    try:
        return parse_mesh(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
