"""The sections of a run's settings: one frozen dataclass per concern, each field with its flag's help and check.

    Network   the model trained      Data         the dataset, its batches   Parallel     the devices, the step
    Compute   kernels, convolutions  Optim        the updates, how many      Cluster      processes, SLURM
    Checkpoints  saving, resuming    Observe      what the run writes and says

``jaxtrain.driver.config.RunConfig`` holds one of each (``config.parallel.strategy``); ``FIELDS`` maps every
setting's name to its section, in the sections' order (the command line's groups, ``--help``'s order);
``check_value`` is a setting's own check (its type, choices and bounds), whatever the others are. JAX is not
imported here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

from jaxtrain.choices import (ACCUM_MODES, AUGMENTATIONS, CONVS, DATASETS, DEFAULT_DATA_DIRS, GPT_SIZES, KERNELS,
                              KJV, LR_SCHEDULES, OPTIMIZERS, PARAM_SHARDINGS, PIPELINE_SCHEDULES, PRECISIONS,
                              STRATEGIES, TRACKERS)
from jaxtrain.errors import ConfigError, named
from jaxtrain.models import MODELS


def _field(default, help: str, *, choices=None, minimum=None, above=None, maximum=None, flag_type=None, empty=None):
    """A setting: its flag's help, its allowed values (``choices``, ``>= minimum``, ``> above``, ``<= maximum``;
    text never empty: ``empty`` says what to give instead)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "minimum": minimum, "above": above, "maximum": maximum,
        "flag_type": flag_type, "empty": empty})


@dataclasses.dataclass(frozen=True)
class Network:
    """The network trained: the model, its init, remat and quantisation, a pretrained start, distillation."""

    model: str = _field("lenet", "model to train (jaxtrain.models registry)", choices=tuple(MODELS))
    model_size: str | None = _field(None, "a language model's network: tiny (tests), mini (a CPU's few minutes), "
                                          "124m, 350m, 774m (GPT-2's) (default: mini)", choices=tuple(GPT_SIZES))
    rotary: bool = _field(False, "a language model's positions rotary (RoPE: each head's queries and keys turned by "
                                 "their position) instead of GPT-2's learned embedding; not with a GPT-2 file "
                                 "(--init-from, export)")
    init: str | None = _field(None, "weight init, where the model offers several (resnet18: d2l or he; "
                                    "default: the first)")
    init_from: str | None = _field(None, "start from another library's weights (.pth or .safetensors): a "
                                         "torchvision or timm ResNet for resnet18_imagenet or resnet50, a timm or "
                                         "Hugging Face ViT/16 for vit_tiny, vit_small or vit_base, a Hugging Face "
                                         "GPT-2 of its --model-size for gpt; a classifier of "
                                         "another class count starts afresh (docs/pretrained.md)")
    linear_probe: bool = _field(False, "fine-tuning: train only the classifier, the rest frozen and run in "
                                       "evaluation mode (BatchNorm on its running statistics, which stay as they "
                                       "are); usually with --init-from")
    remat: str = _field("none", "remat policy per block: none, full, dots, dots_no_batch; offload_dots, "
                                "offload_dots_no_batch, offload_names:NAME,... (saved in the host's pinned memory "
                                "on GPUs; a CPU keeps them in its one memory); or a jax.checkpoint_policies name")
    quantize: str = _field("none", "quantisation-aware training: int8 rounds each conv / dense layer's weights (a "
                                   "scale per output channel) and inputs (a scale per example) to int8 in the "
                                   "forward pass, gradients straight through (lenet)", choices=("none", "int8"))
    teacher: str | None = _field(None, "distil from this finished run (its --out directory, holding model/ and "
                                       "model.json): its softened outputs join the loss (docs: Smaller models)")
    # T 2, alpha 0.5: the defaults train at the student recipe's own pace (T 4, alpha 0.9 left a LeNet student at
    # chance for 3 epochs: docs/smaller-models.md, "Distillation").
    temperature: float = _field(2.0, "distillation: softmax temperature T of teacher and student", above=0.0)
    alpha: float = _field(0.5, "distillation: weight of the soft (teacher) loss; 1 - alpha goes to the labels' "
                               "cross-entropy", minimum=0.0)


@dataclasses.dataclass(frozen=True)
class Compute:
    """How its operations are computed: the fused kernels and the convolutions."""

    kernels: str = _field("jnp", "jnp (XLA fuses the ops), or pallas: the fused Pallas kernels of jaxtrain.kernels "
                                 "for the image models' train loss (softmax cross-entropy) and the ViT's layer "
                                 "norms, not the GPT's (Triton on GPUs; interpret mode on CPUs, slow there; "
                                 "docs/kernels.md)", choices=KERNELS)
    conv: str = _field("auto", "the models' convolutions, and a GPT's attention products: auto (oneDNN's on a CPU "
                               "where they build, else XLA's), xla, or onednn (f32 NHWC convs and the GPT's fp32 "
                               "attention on CPUs; docs/performance.md, \"oneDNN convolutions\")", choices=CONVS)


@dataclasses.dataclass(frozen=True)
class Data:
    """The dataset and how its batches are made and fed."""

    dataset: str = _field("fashion_mnist", f"dataset to train on: {', '.join(DATASETS)}, tfds:NAME (an image "
                                           "classification dataset TFDS has prepared in --tfds-dir), folder:DIR "
                                           "(images in DIR/train/CLASS/ and DIR/val/CLASS/, or DIR/CLASS/ with "
                                           "--val-fraction; streamed from disk, decoded by --workers processes), or "
                                           "text:PATH (a text file or a folder of them: a language model's; default "
                                           f"for gpt: {KJV}, the King James Bible: make kjv)")
    data_dir: str | None = _field(None, "directory of the dataset's files: the four IDX files (train-images-idx3-"
                                        "ubyte[.gz], ...) or CIFAR-10's binary batches (data_batch_1.bin, ..., "
                                        f"test_batch.bin); default for fashion_mnist: "
                                        f"{DEFAULT_DATA_DIRS['fashion_mnist']} (Debian package)")
    tfds_dir: str | None = _field(None, "TFDS data dir where the converted dataset is cached (default: "
                                        "$TFDS_DATA_DIR or ~/tensorflow_datasets)")
    classes: str | None = _field(None, "train and evaluate on these classes only, comma-separated names (a "
                                       "folder's sub-folders; cifar10's airplane, ..., truck) or label numbers, "
                                       "relabelled 0..k-1 in the order given (e.g. cat,deer,dog,frog,horse,bird)",
                                 empty="name at least two classes (e.g. cat,dog), or leave it out to train on every "
                                       "class")
    train_subset: int | None = _field(None, "train on the first N training examples only (CPU-sized runs); the test "
                                            "set stays whole", minimum=1)
    test_subset: int | None = _field(None, "evaluate on the first N test examples only (smoke runs); default: every "
                                           "test example", minimum=1)
    image_size: int | None = _field(None, "folder:DIR: the side images are resized to (default: the model's "
                                          "recipe: 224 for resnet50, 32 otherwise)", minimum=1)
    val_fraction: float | None = _field(None, "folder:DIR without train/ and val/: the share of each class held "
                                              "out for evaluation (a fixed split); text:PATH: the share of the text "
                                              "held out, its end (default 0.1)", above=0.0)
    on_bad_image: str = _field("skip", "folder:DIR: a file that fails to decode is skipped (replaced by the next, "
                                       "counted, one warning line per epoch) or an error", choices=("skip", "error"))
    seq_len: int | None = _field(None, "text:PATH: tokens a language model sees at once; each example is a window "
                                       "of seq_len + 1 tokens (default: the model size's: 128 for mini, 1024 for "
                                       "GPT-2's)", minimum=1)
    tokenizer: str | None = _field(None, "text:PATH: bpe (a byte-level BPE trained on the training text, "
                                         "--vocab-size tokens), bytes (256), or a tokenizer.json file (e.g. "
                                         "GPT-2's); tokens cached by a digest of the text and the tokenizer "
                                         "(default: bpe)")
    vocab_size: int | None = _field(None, "text:PATH with --tokenizer bpe: the BPE's vocabulary (257..65536; "
                                          "default: 4096)", minimum=257)
    augment: str | None = _field(None, "training-time augmentation: crop+flip (pad 4, random crop back to the "
                                       "image size, horizontal flip), rrc+flip (image folders: ImageNet's random-"
                                       "resized-crop and flip) or none; drawn from seed, epoch and example index; "
                                       "never on the test set (default: none; a folder: the model's recipe, "
                                       "rrc+flip for resnet50)", choices=AUGMENTATIONS)
    workers: int = _field(0, "grain workers building batches ahead: threads, or processes decoding a folder's "
                             "images (0: in the prefetch thread; docs: Data)",
                          minimum=0)
    prefetch: int = _field(2, "batches copied to the devices ahead of the step by a background thread (0: off)",
                           minimum=0)
    data_on_device: str = _field("auto", "hold the training split on the devices and gather each call's batches "
                                         "there (the loader's batches, bit for bit; nothing copied in an epoch): "
                                         "on, off, or auto (on for an in-memory split within a quarter of a GPU's "
                                         "memory; off on CPUs and for image folders)", choices=("auto", "on", "off"))


@dataclasses.dataclass(frozen=True)
class Optim:
    """The updates: optimizer, learning rate and its schedule, what trains, for how long."""

    epochs: int | None = _field(None, "passes over the training set (default: the model's recipe)", minimum=1)
    batch_size: int | None = _field(None, "GLOBAL batch per optimizer update, split evenly over the devices (and "
                                          "micro-batches) (default: the model's recipe)", minimum=1)
    lr: float | None = _field(None, "(peak) learning rate (default: the model's recipe)", above=0.0)
    optimizer: str | None = _field(None, "optax optimizer: sgd, momentum / nesterov (SGD, momentum 0.9), adam, adamw "
                                         "(default: the model's recipe: sgd for lenet/resnet18, adam for vit)",
                                   choices=OPTIMIZERS)
    schedule: str | None = _field(None, "learning-rate schedule over the run's updates: constant, cosine (to 0), "
                                       "warmup_cosine (linear warm-up from 0, then cosine), onecycle (up over the "
                                       "warm-up, default 30%% of the run, then down) (default: the model's recipe: "
                                       "constant for lenet/resnet18, warmup_cosine for vit)", choices=LR_SCHEDULES)
    warmup_epochs: float | None = _field(None, "warm-up length in epochs (warmup_cosine, onecycle) (default: the "
                                               "model's recipe: 0.5 for vit)", minimum=0.0)
    weight_decay: float = _field(0.0, "weight decay of kernels (not biases or norm scales): decoupled for adamw, "
                                      "an L2 term in the gradient otherwise", minimum=0.0)
    clip_grad_norm: float | None = _field(None, "clip the gradient to this global norm (over every parameter, "
                                                "whatever the sharding)", above=0.0)
    freeze: str | None = _field(None, "fine-tuning: a regex over parameter names (e.g. 'blocks/[0-5]/' or "
                                      "'^(?!dense/)', all but the classifier: a linear probe): those are never "
                                      "updated and get no optimizer state")
    lr_groups: str | None = _field(None, "fine-tuning: per-group learning rates, 'REGEX=LR,...' (e.g. "
                                         "'dense/=1e-2,blocks/[67]/=1e-3'): a parameter takes the first matching "
                                         "group's peak lr (the same schedule), the rest --lr")
    max_steps: int | None = _field(None, "stop after this many train steps in total (for smoke runs), then evaluate",
                                   minimum=1)
    seed: int = _field(0, "seed of the init and of the shuffling", minimum=0, maximum=2**63 - 1)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The devices and the parallel step: strategy, sharding, precision, accumulation, pipelines."""

    devices: int | None = _field(None, "devices to train on: on CPU this many virtual devices sharing the cores "
                                       "(default: one per core), on GPU the first N GPUs (default: all)", minimum=1)
    mesh: dict | None = _field(None, "named mesh axes, their product = --devices (default: data over every device); "
                                     "the batch is split over 'data' and replicated over 'model'", flag_type="mesh")
    strategy: str = _field("jit", "parallel strategy: jit (XLA inserts the collectives), explicit (Explicit mesh "
                                  "axes, shardings in the types, gathers and reductions as reshards), shard_map "
                                  "(explicit pmean; all-gather and reduce-scatter under fsdp), pmap (legacy API, "
                                  "replicated only), ring (our ppermute ring)", choices=STRATEGIES)
    param_sharding: str = _field("replicated", "where parameters and optimizer state live: replicated (data "
                                               "parallelism), fsdp (sharded over the data axis, ZeRO-3), zero1 "
                                               "(optimizer state sharded, parameters replicated), tp (the "
                                               "model's tensor-parallel rules over the 'model' axis; jit, explicit), "
                                               "fsdp+tp (both, on a 2-D --mesh)", choices=PARAM_SHARDINGS)
    precision: str = _field("fp32", "compute dtype (fp32 master params either way); fp16 uses a dynamic loss scale",
                            choices=PRECISIONS)
    accum_steps: int = _field(1, "gradient accumulation: micro-batches per optimizer update", minimum=1)
    accum: str = _field("scan", "scan: one call = one update over k micro-batches (one all-reduce); multisteps: "
                                "optax.MultiSteps, one call per micro-batch, an update every k calls",
                        choices=ACCUM_MODES)
    microbatches: int = _field(1, "pipelined runs (a 'stage' axis in --mesh): micro-batches per step; the bubble "
                                  "is (stages-1)/(repeats*microbatches+stages-1)", minimum=1)
    pipeline_schedule: str = _field("gpipe", "pipelined runs: gpipe, or circular (each stage holds --repeats "
                                             "chunks of layers)", choices=PIPELINE_SCHEDULES)
    repeats: int = _field(1, "pipelined runs, circular schedule: layer chunks per stage", minimum=1)
    steps_per_call: str = _field("auto", "train steps in one compiled call: N, or auto (GPUs: enough steps for "
                                         "~10 ms of device work a call, measured; CPUs: 1); a call ends where a "
                                         "checkpoint or step evaluation is due (a log line comes after the call "
                                         "that passes its step), and a signal stops the run at the end of the "
                                         "call in flight, at most N steps later (docs: Keeping the GPU busy)")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Multi-process and SLURM runs."""

    devices_per_process: int | None = _field(None, "multi-process runs: CPU virtual devices per process "
                                                   "(python -m jaxtrain.launch sets it)", minimum=1)
    coordinator: str | None = _field(None, "multi-process runs without the launcher: HOST:PORT of process 0's "
                                           "coordinator")
    num_processes: int | None = _field(None, "multi-process runs: process count", minimum=1)
    process_id: int | None = _field(None, "multi-process runs: this process's id (0..N-1)", minimum=0)
    stall_timeout: float = _field(600.0, "multi-process runs: end the run (exit 124, naming the process) when no "
                                         "train step finishes for this many seconds, e.g. a collective waiting on "
                                         "a stuck process; must exceed an evaluation pass; 0: never", minimum=0.0)
    requeue_on_signal: bool = _field(False, "in a SLURM job: after the checkpoint of SIGUSR1 (--signal=B:USR1@120 "
                                            "warns before a time limit), requeue the job with scontrol, to go on "
                                            "from it (needs --checkpoint-dir and --resume)")


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Checkpoints and resuming."""

    checkpoint_dir: str | None = _field(None, "save orbax checkpoints (TrainState + data position) here, at every "
                                              "epoch end")
    checkpoint_every: int | None = _field(None, "also checkpoint every N train steps", minimum=1)
    keep_checkpoints: int = _field(3, "keep the newest K checkpoints", minimum=1)
    resume: bool = _field(False, "continue exactly where the newest readable checkpoint in --checkpoint-dir stopped")


@dataclasses.dataclass(frozen=True)
class Observe:
    """What the run writes and says."""

    out: str | None = _field(None, "output directory for metrics.jsonl, summary.json, curves.png and the "
                                   "TensorBoard events (default: a fresh runs/NAME-DATE-TIME)")
    no_progress: bool = _field(False, "no progress bars (they show only on a terminal anyway)")
    log_every: int | None = _field(None, "print a line every N steps (loss, examples/s or tokens/s, the MFU where "
                                         "the peak is known, data wait; read one step late, never waiting for the "
                                         "device) and log them to TensorBoard",
                                   minimum=1)
    eval_every: int = _field(1, "evaluate on the test set every N epochs (and after the last)", minimum=1)
    eval_every_steps: int | None = _field(None, "also evaluate every N train steps (a line, and TensorBoard's "
                                                "test_step/ scalars)", minimum=1)
    profile: str | None = _field(None, "write a jax.profiler trace of steps START..STOP-1 to OUT/profile (open "
                                       "it in XProf, TensorBoard or ui.perfetto.dev; docs: Getting started, "
                                       "'Watching a run')", flag_type="steps")
    memory_report: bool = _field(False, "print host and device memory at the start and after the first step")
    summary: bool = _field(False, "print the model summary (parameters per layer, bytes, FLOPs per example) "
                                  "before training")
    measure_peak: bool = _field(False, "measure this device's fp32 matmul peak once, for the MFU in summary.json "
                                       "(GPUs use datasheet peaks without it)")
    track: str = _field("none", "also log the run to an experiment tracker (pip install 'jaxtrain[wandb]' or "
                                "'jaxtrain[mlflow]'): wandb runs OFFLINE under OUT/wandb unless you logged in "
                                "(wandb login / WANDB_API_KEY; upload later with wandb sync); mlflow logs to "
                                "sqlite:///OUT/mlflow.db unless MLFLOW_TRACKING_URI is set",
                        choices=TRACKERS)
    track_group: str | None = _field(None, "the tracker's group of this run (W&B group, MLflow experiment; a sweep "
                                           "gives its study's name)")


# The sections by their attribute in a RunConfig, in order.
SECTIONS = {"network": Network, "compute": Compute, "data": Data, "optim": Optim, "parallel": Parallel,
            "cluster": Cluster, "checkpoint": Checkpoints, "observe": Observe}
# Every setting: name -> (its section's attribute, its dataclasses.Field), in the sections' order.
FIELDS = {f.name: (attr, f) for attr, section in SECTIONS.items() for f in dataclasses.fields(section)}
# The settings in the order a command line writes them (``cli.to_argv``: a sweep's stored command, compared when it
# resumes) and their checks run (the first bad one is said): the order they had before the sections.
ORDER = ("model", "devices", "devices_per_process", "coordinator", "num_processes", "process_id", "strategy",
         "param_sharding", "mesh", "precision", "accum_steps", "accum", "remat", "epochs", "batch_size", "lr", "init",
         "seed", "freeze", "linear_probe", "lr_groups", "classes", "init_from", "dataset", "data_dir", "augment",
         "image_size", "val_fraction", "model_size", "seq_len", "tokenizer", "vocab_size", "rotary", "on_bad_image",
         "tfds_dir", "out", "workers", "prefetch", "steps_per_call", "data_on_device", "max_steps", "memory_report",
         "summary", "measure_peak", "train_subset", "test_subset", "checkpoint_dir", "checkpoint_every",
         "keep_checkpoints", "resume", "requeue_on_signal", "stall_timeout", "no_progress", "log_every", "optimizer",
         "schedule", "warmup_epochs", "weight_decay", "clip_grad_norm", "microbatches", "pipeline_schedule", "repeats",
         "quantize", "kernels", "conv", "teacher", "temperature", "alpha", "eval_every", "eval_every_steps", "profile",
         "track", "track_group")


def check_values(values: dict) -> None:
    """Each field's own check (its type, its choices, ``>= minimum``, ``> above``, ``<= maximum``, finite, text not
    empty): a ConfigError naming the first bad one, in the fields' order."""
    for name in ORDER:
        check_value(name, values[name])


def check_value(name: str, value) -> None:
    """Setting ``name``'s own check of ``value`` (a ConfigError naming it), whatever the other settings are."""
    field = FIELDS[name][1]
    meta = field.metadata
    if value is None:
        return
    if expected := _mistyped(value, field.type):
        raise ConfigError(f"{named(name, repr(value))}: expected {expected}")
    if isinstance(value, bool):
        return
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"{named(name, repr(value))}: empty; "
                          f"{meta['empty'] or 'give a value, or leave it out for its default'}")
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
        raise ConfigError(f"{named(name, value)}: expected a finite number")  # inf would pass "> 0", then diverge
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{named(name, repr(value))}: not one of {', '.join(meta['choices'])}")
    if meta["minimum"] is not None and not value >= meta["minimum"]:
        raise ConfigError(f"{named(name, value)}: expected a number >= {meta['minimum']}")
    if meta["above"] is not None and not value > meta["above"]:
        raise ConfigError(f"{named(name, value)}: expected a number > {meta['above']}")
    if meta["maximum"] is not None and not value <= meta["maximum"]:
        raise ConfigError(f"{named(name, value)}: expected a number <= {meta['maximum']}")


def plain_value(value):
    """A path as its text (``out=Path(...)``), a NumPy number as Python's (``epochs=np.int64(3)``: what the run
    writes to JSON), anything else as it is (checked next)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):  # mesh={"data": np.int64(2)}
        return {k: plain_value(v) for k, v in value.items()}
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":  # np.True_: a switch
        return bool(value)
    if isinstance(value, numbers.Integral) and type(value) not in (int, bool):
        return int(value)
    if isinstance(value, numbers.Real) and type(value) not in (int, float, bool):  # np.float64 too
        return float(value)
    return value


# A setting's annotation -> the Python types it takes, and how a message names them (a float takes an int too).
_TYPES = {"str": ((str,), "text"), "int": ((numbers.Integral,), "a whole number"),
          "float": ((numbers.Real,), "a number"), "bool": ((bool,), "True or False"),
          "dict": ((dict,), "a dict of mesh axes, e.g. {'data': 2}")}


def _mistyped(value, annotation: str) -> str | None:
    """What ``value`` should have been (a few words), where its type is not its setting's (``"int | None"``); a
    bool is no number here, though Python's bool is an int."""
    kinds = [_TYPES[t] for t in annotation.replace(" ", "").split("|") if t in _TYPES]
    if any(isinstance(value, types) and not (isinstance(value, bool) and bool not in types) for types, _ in kinds):
        return None
    return " or ".join(words for _, words in kinds)
