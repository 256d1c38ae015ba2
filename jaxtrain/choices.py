"""The library's named choices, in one JAX-free place (the command line reads them before JAX is imported)."""

import math

STRATEGIES = ("jit", "explicit", "shard_map", "pmap", "ring")  # jaxtrain.parallel.strategies
PRECISIONS = ("fp32", "bf16", "fp16")  # jaxtrain.core.precision.POLICIES
ACCUM_MODES = ("scan", "multisteps")  # jaxtrain.core.accumulate
MODEL_AXES = ("auto", "explicit")  # the axis types a model is traced under with strategy="explicit"
PARAM_SHARDINGS = ("replicated", "fsdp", "zero1", "hsdp", "tp", "fsdp+tp")  # jaxtrain.parallel.rules.preset
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")  # jaxtrain.core.optim
LR_SCHEDULES = ("constant", "cosine", "warmup_cosine", "onecycle")  # jaxtrain.core.optim.make_schedule
PIPELINE_SCHEDULES = ("gpipe", "circular")  # pipeline schedules (jaxtrain.train.pipeline)
KERNELS = ("jnp", "pallas")  # the train loss's cross-entropy: optax's, or jaxtrain.kernels.softmax_ce
CONVS = ("auto", "xla", "onednn")  # the models' convolutions: jaxtrain.kernels.onednn.choose
AUGMENTATIONS = ("none", "crop+flip", "rrc+flip")  # jaxtrain.data.augment; rrc+flip: data.images (folders)
DATASETS = ("fashion_mnist", "mnist", "cifar10")  # jaxtrain.data.sources.LOCAL; and "tfds:NAME"
TRACKERS = ("none", "wandb", "mlflow")  # --track: jaxtrain.driver.track
INT8_AFTER_TRAINING = ("lenet", "resnet18")  # the models post-training int8 covers (jaxtrain.analysis.quantize)
DEFAULT_DATA_DIRS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}
TFDS_PREFIX = "tfds:"
FOLDER_PREFIX = "folder:"  # a folder of images, one sub-folder per class (jaxtrain.data.folder)
TEXT_PREFIX = "text:"  # a text file, or a folder of them, for a language model (jaxtrain.data.text)
KJV = "~/.cache/jaxtrain/kjv/kjv.txt"  # the language models' offline corpus: `make kjv` writes it (Debian's bible-kjv)
TOKENIZERS = ("bpe", "bytes")  # jaxtrain.data.text; or the path of a tokenizer.json
BPE_VOCAB = 4096  # a run's vocab_size unless told, with tokenizer=bpe (other tokenizers have their own)
# jaxtrain.models.gpt.SIZES: each size's context (its seq_len unless told)
GPT_SIZES = {"tiny": 64, "mini": 128, "124m": 1024, "350m": 1024, "774m": 1024}
MESH_AXES = ("replica", "data", "model", "stage")  # a run's mesh's names (parallel.devices, train.pipeline)


def check_dataset(name: str) -> None:
    """A ConfigError unless ``name`` is one of DATASETS or ``tfds:NAME``."""
    from jaxtrain.errors import ConfigError

    prefixes = (TFDS_PREFIX, FOLDER_PREFIX, TEXT_PREFIX)
    if name not in DATASETS and not any(name.startswith(p) and len(name) > len(p) for p in prefixes):
        raise ConfigError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)}, tfds:NAME for a dataset "
                          "TFDS has prepared, folder:DIR for a folder of images (one sub-folder per class), or "
                          "text:PATH for a text file or a folder of them (a language model's)")


def lr_groups(text: str | None) -> tuple[tuple[str, float], ...]:
    """'REGEX=LR,...' -> ((regex, lr), ...): items split at ",", each at its last "="; a one-line ConfigError
    for an item without a finite positive number after its "="."""
    from jaxtrain.errors import ConfigError, named

    groups = []
    for item in text.split(",") if text else ():
        pattern, _, value = item.strip().rpartition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = 0.0
        if not pattern or not 0 < lr < math.inf:
            raise ConfigError(f"{named('lr_groups', repr(text))}: give REGEX=LR items separated by commas, each LR "
                              f"a finite number > 0 (e.g. 'dense/=1e-2,blocks/7/=1e-3'); {item.strip()!r} is not one")
        groups.append((pattern, lr))
    return tuple(groups)


# A loss_fn's metric: the share of its batch's labels outside the classes (jaxtrain.models.classify reports it;
# the trainer and the loop read it for every step once it is done: jaxtrain.parallel.call_checks).
LABELS_OUT_OF_RANGE = "labels_out_of_range"
