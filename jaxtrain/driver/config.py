"""RunConfig: every setting of a training run, frozen, in one section per concern (``jaxtrain.driver.sections``).

Built from the command line by ``jaxtrain.cli`` or directly in Python, from the settings by name::

    jt.run(RunConfig(model="lenet", devices=2, epochs=1))
    config.parallel        # Parallel(devices=2, mesh=None, strategy='jit', ...): what the step's builder takes

The model's recipe fills what is not given before the sections are made (``with_recipe``). Each setting's
metadata holds its flag's help and its check; a bad value is a ``ConfigError`` naming the setting
(``batch_size=0: ...``; the command line says it as its flag, ``--batch-size 0: ...``). JAX is not imported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from pathlib import Path

from jaxtrain.choices import (BPE_VOCAB, DATASETS, FOLDER_PREFIX, GPT_SIZES, TEXT_PREFIX, TFDS_PREFIX, TOKENIZERS,
                              check_dataset, lr_groups)
from jaxtrain.driver.sections import (FIELDS, ORDER, SECTIONS, Checkpoints, Cluster, Compute, Data, Network,
                                      Observe, Optim, Parallel, check_values, plain_value)
from jaxtrain.errors import ConfigError, named
from jaxtrain.models import MODELS

# Left None, these come from the model's recipe (jaxtrain.models.MODELS).
RECIPE_FIELDS = ("epochs", "batch_size", "lr", "optimizer", "schedule", "warmup_epochs")
# Left None, these depend on the dataset too (an image folder's come from the recipe; text's: TEXT_DEFAULTS).
DATASET_FIELDS = ("augment", "image_size", "val_fraction", "model_size", "seq_len", "tokenizer", "vocab_size")
# A language model's text (dataset=text:PATH) unless told; seq_len: the model size's (jaxtrain.models.gpt.SIZES).
TEXT_DEFAULTS = {"model_size": "mini", "tokenizer": "bpe", "val_fraction": 0.1}
TEXT_FIELDS = ("model_size", "seq_len", "tokenizer", "vocab_size")  # set for text only: None for images


# Settings that change what a checkpoint's state means: resume refuses to mix them.
FIXED_SETTINGS = ("experiment", "model_revision", "dataset", "data_sha256", "classes", "init_from", "freeze",
                  "linear_probe", "lr_groups", "train_subset", "optimizer", "lr", "schedule", "warmup_epochs",
                  "weight_decay", "clip_grad_norm", "augment", "image_size", "batch_size", "seed", "precision",
                  "accum_steps", "accum", "pipeline_layout", "quantize", "teacher", "temperature", "alpha",
                  "rotary", *TEXT_FIELDS)
# Recorded only when set: checkpoints older than them still resume.
OPTIONAL_SETTINGS = ("linear_probe", "rotary", *TEXT_FIELDS)
# Settings a resumed run may change (reported when they do).
FREE_SETTINGS = ("devices", "processes", "strategy", "mesh", "param_sharding", "remat", "epochs", "max_steps",
                 "microbatches", "kernels", "conv", "test_subset", "steps_per_call", "data_on_device")


@dataclasses.dataclass(frozen=True)
class _Sections:
    """RunConfig's value: one frozen section per concern (``jaxtrain.driver.sections``)."""

    network: Network
    compute: Compute
    data: Data
    optim: Optim
    parallel: Parallel
    cluster: Cluster
    checkpoint: Checkpoints
    observe: Observe

    def __post_init__(self):
        check_values(self.flat())
        if self.data_on_device == "on" and self.dataset.startswith(FOLDER_PREFIX):
            raise on_host_only(text=False)
        if self.profile is not None:
            start, _ = parse_steps(self.profile)
            if self.max_steps is not None and start > self.max_steps:
                raise ConfigError(f"{named('profile', self.profile)}: starts after "
                                  f"{named('max_steps', self.max_steps)}, so nothing would be traced; profile steps "
                                  "within the run")
        if self.microbatches > 1 and "stage" not in (self.mesh or {}):
            raise ConfigError(f"{named('microbatches', self.microbatches)}: micro-batches split a pipelined step; "
                              f"give {named('mesh')} a 'stage' axis (e.g. data=1,stage=4), or use "
                              f"{named('accum_steps')} to accumulate gradients")
        for name in self._given("pipeline_schedule", "repeats"):
            if "stage" not in (self.mesh or {}):
                raise ConfigError(f"{named(name, getattr(self, name))}: for a pipelined step; give {named('mesh')} "
                                  "a 'stage' axis (e.g. data=1,stage=4), or leave it out")
        if (unused := self._given("temperature", "alpha")) and not self.teacher:
            raise ConfigError(f"{' and '.join(named(n, getattr(self, n)) for n in unused)}: distillation's, with "
                              f"{named('teacher', 'RUN_DIR')}; give a teacher, or leave them out")
        if self.track_group is not None and self.track == "none":
            raise ConfigError(f"{named('track_group', self.track_group)}: a tracker's group; give "
                              f"{named('track', 'wandb')} or mlflow, or leave it out")
        if self.lr_groups is not None:
            lr_groups(self.lr_groups)  # its one-line error now
        if self.linear_probe and self.freeze:
            raise ConfigError(f"{named('linear_probe')} with {named('freeze', repr(self.freeze))}: a linear probe "
                              "freezes all but the classifier itself; give one of them")
        if self.linear_probe and (self.teacher or "stage" in (self.mesh or {})):
            raise ConfigError(f"{named('linear_probe')}: a plain run's classifier only (not with {named('teacher')} "
                              "or a pipelined mesh's 'stage' axis)")
        if self.init_from and self.teacher:
            raise ConfigError(f"{named('init_from')} with {named('teacher')}: a distilled student starts from its "
                              "own init (train the pretrained network first, then distil from that run)")
        if self.alpha > 1:
            raise ConfigError(f"{named('alpha', self.alpha)}: expected a weight in [0, 1]")
        if self.checkpoint_dir is not None and self.out is not None:
            _check_apart(Path(self.checkpoint_dir), Path(self.out))
        if self.init not in MODELS[self.model].inits:
            raise ConfigError(f"{named('init', self.init)}: model {self.model} has no such init; choose one of "
                              f"{', '.join(MODELS[self.model].inits)}")

    def _given(self, *names: str) -> list[str]:
        """Those of ``names`` set to other than their default."""
        return [n for n in names if getattr(self, n) != FIELDS[n][1].default]

    def flat(self) -> dict:
        """Every setting by its name (``{"model": "lenet", ..., "track_group": None}``), in the sections' order."""
        return {name: getattr(getattr(self, section), name) for name, (section, _) in FIELDS.items()}

    def __getattr__(self, name: str):  # config.batch_size: its section's (config.optim.batch_size)
        if name in FIELDS:
            return getattr(getattr(self, FIELDS[name][0]), name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


class RunConfig(_Sections):
    """Every setting of a training run, frozen, in sections (``config.network``, ``.data``, ``.optim``,
    ``.parallel``, ...; ``config.lr`` reads ``config.optim.lr``). Made from the settings by name, as the command
    line's flags name them (``RunConfig(model="lenet", devices=2)``; ``model`` and ``devices`` may come first,
    without their names; a whole section too, ``parallel=Parallel(...)``, the settings named beside it winning);
    the model's recipe fills what is not given (``epochs``, ``batch_size``, ``lr``,
    ``optimizer``, ``schedule``, ``warmup_epochs``, ``init``; an image folder's ``augment`` and ``image_size``;
    text's sizes) before the sections are made: a RunConfig never changes itself."""

    def __init__(self, *args, **given):
        if len(args) > len(POSITIONAL) or set(POSITIONAL[:len(args)]) & set(given):
            raise TypeError(f"RunConfig takes {' and '.join(POSITIONAL)} first, then settings by name, each once")
        sections = {}  # whole sections given (dataclasses.replace gives every one): their settings, the named win
        for attr in [k for k in given if k in SECTIONS and isinstance(given[k], SECTIONS[k])]:
            sections.update(dataclasses.asdict(given.pop(attr)))
        given = with_recipe({**sections, **dict(zip(POSITIONAL, args)), **given})
        super().__init__(**{attr: section(**{f.name: given[f.name] for f in dataclasses.fields(section)
                                              if f.name in given})
                            for attr, section in SECTIONS.items()})

    def replace(self, **changes) -> RunConfig:
        """This config with ``changes`` (settings by name), checked again."""
        return RunConfig(**{**self.flat(), **changes})


POSITIONAL = ("model", "devices")  # RunConfig("resnet18", 2)
RunConfig.__signature__ = inspect.Signature(  # help(), IDEs and the docs show the settings
    [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD if name in POSITIONAL else
                       inspect.Parameter.KEYWORD_ONLY, default=FIELDS[name][1].default, annotation=FIELDS[name][1].type)
     for name in ORDER])


def with_recipe(given: dict) -> dict:
    """``given`` (RunConfig's keyword arguments) with what it leaves to the model's recipe filled in, and
    ``steps_per_call`` and paths as text (``8`` -> ``"8"``, ``Path("runs/a")`` -> ``"runs/a"``); an unknown model
    or dataset is a ConfigError here."""
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        near = {k: difflib.get_close_matches(k, FIELDS, n=1) for k in unknown}  # batchsize: batch_size
        words = [f"{k!r}" + (f" (did you mean {near[k][0]!r}?)" if near[k] else "") for k in unknown]
        raise TypeError(f"RunConfig got unexpected keyword argument(s) {', '.join(words)}")
    given = {k: plain_value(v) for k, v in given.items()}
    steps = as_given = given.get("steps_per_call", "auto")  # RunConfig(steps_per_call=8) too
    if isinstance(steps, int) and not isinstance(steps, bool):
        given["steps_per_call"] = str(steps)
    check_values({name: given.get(name, f.default) for name, (_, f) in FIELDS.items()})
    model = given.setdefault("model", "lenet")
    if model not in MODELS:  # None too
        raise ConfigError(f"{named('model', repr(model))}: not one of {', '.join(MODELS)}")
    if given.get("dataset") is None:  # the command line's --model without --dataset gives None
        given["dataset"] = MODELS[model].dataset
    dataset = given["dataset"]
    try:
        check_dataset(dataset)
    except ConfigError as e:
        raise ConfigError(f"{named('dataset')}: {e}") from None
    steps = given.get("steps_per_call", "auto")
    if steps != "auto" and not (steps.isascii() and steps.isdecimal() and int(steps) >= 1):
        raise ConfigError(f"{named('steps_per_call', repr(as_given))}: expected a whole number >= 1, or auto")
    given["steps_per_call"] = steps if steps == "auto" else str(int(steps))
    recipe, folder, text = MODELS[model], dataset.startswith(FOLDER_PREFIX), dataset.startswith(TEXT_PREFIX)
    if recipe.text != text:
        raise ConfigError(f"{named('model', model)} with {named('dataset', dataset)}: " + (
            f"a language model trains on text ({named('dataset', 'text:PATH')})" if recipe.text else
            f"text is a language model's ({', '.join(n for n, d in MODELS.items() if d.text)}); {model} takes images"))
    if not folder and given.get("image_size") is not None:
        raise ConfigError(f"{named('image_size')} is for image folders ({named('dataset', 'folder:DIR')})")
    tfds = dataset.startswith(TFDS_PREFIX)
    if (folder or tfds) and given.get("data_dir") is not None:
        raise ConfigError(f"{named('data_dir')} is for the local datasets' files ({', '.join(DATASETS)}); "
                          f"{named('dataset', dataset)} names its own place"
                          + (f" (in {named('tfds_dir')})" if tfds else ""))
    if (folder or text) and given.get("tfds_dir") is not None:
        raise ConfigError(f"{named('tfds_dir')} is where TFDS keeps the local datasets' conversions and tfds:NAME "
                          f"datasets; {'an image folder' if folder else 'text'} keeps a cache of its own "
                          "(JAXTRAIN_INDEX_CACHE: docs/settings.md)")
    if not folder and given.get("on_bad_image", "skip") != "skip":
        raise ConfigError(f"{named('on_bad_image', given['on_bad_image'])} is for image folders "
                          f"({named('dataset', 'folder:DIR')}), whose files are decoded as a run streams them")
    if not (folder or text) and given.get("val_fraction") is not None:
        raise ConfigError(f"{named('val_fraction')} is for image folders ({named('dataset', 'folder:DIR')}) and "
                          f"text ({named('dataset', 'text:PATH')})")
    if not text and (given_text := [k for k in TEXT_FIELDS if given.get(k) is not None]
                     + ["rotary"] * bool(given.get("rotary"))):
        raise ConfigError(f"{' and '.join(map(named, given_text))} {'is' if len(given_text) == 1 else 'are'} for a "
                          f"language model's text ({named('dataset', 'text:PATH')})")
    if text:
        for name, value in TEXT_DEFAULTS.items():
            if given.get(name) is None:
                given[name] = value
        if given.get("seq_len") is None:
            given["seq_len"] = GPT_SIZES[given["model_size"]]
        if given.get("augment") not in (None, "none"):
            raise ConfigError(f"{named('augment', given['augment'])}: text has no augmentation")
        for name in ("classes", "data_dir"):
            if given.get(name) is not None:
                raise ConfigError(f"{named(name)} is for image datasets; text:PATH has no classes and names its "
                                  "files itself")
        if given.get("data_on_device") == "on":
            raise on_host_only(text=True)
        if given["tokenizer"] != "bpe":
            if given.get("vocab_size") is not None:
                raise ConfigError(f"{named('vocab_size')} is the BPE's ({named('tokenizer', 'bpe')}); "
                                  f"{named('tokenizer', given['tokenizer'])} has its own vocabulary")
        elif given.get("vocab_size") is None:
            given["vocab_size"] = BPE_VOCAB
    for name in RECIPE_FIELDS:
        if given.get(name) is None:
            given[name] = getattr(recipe, name)
    if given.get("init") is None:
        given["init"] = recipe.inits[0]
    if given.get("augment") is None:
        given["augment"] = recipe.folder_augment if folder else "none"
    if text and given.get("tokenizer") not in TOKENIZERS and not Path(given["tokenizer"]).expanduser().is_file():
        what = "a directory" if Path(given["tokenizer"]).expanduser().is_dir() else "no such file"
        raise ConfigError(f"{named('tokenizer', given['tokenizer'])}: not {' or '.join(TOKENIZERS)}, and {what} "
                          "(give the path of a tokenizer.json)")
    if folder and given.get("image_size") is None:
        given["image_size"] = recipe.image_size
    return given


def on_host_only(text: bool) -> ConfigError:
    """``data_on_device=on`` refused for data the host prepares: text's windows (cut there) or an image folder's
    files (decoded there)."""
    why, what = (("text's windows are cut on the host (the device-resident path holds image splits)", "text") if text
                 else ("an image folder is streamed from its files, decoded on the host", "a folder"))
    return ConfigError(f"{named('data_on_device', 'on')}: {why}; use {named('data_on_device', 'auto')} or off for "
                       f"{what}")


def _check_apart(checkpoints: Path, out: Path) -> None:
    """checkpoint_dir and out must not hold each other's files: the export rewrites OUT/model, and a
    checkpoint directory holds checkpoints only. A subdirectory of out other than model/ is fine."""
    ck, out = checkpoints.expanduser().resolve(), out.expanduser().resolve()
    if ck == out or ck.is_relative_to(out / "model") or out.is_relative_to(ck):
        raise ConfigError(f"{named('checkpoint_dir', checkpoints)} and {named('out', out)} overlap (the saved model "
                          f"goes to {out / 'model'}); use separate directories, e.g. "
                          f"{named('checkpoint_dir', out / 'checkpoints')}")


def parse_steps(text: str) -> tuple[int, int]:
    """``--profile START:STOP`` -> (START, STOP), 1 <= START < STOP."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"{named('profile', repr(text))}: expected START:STOP, two step numbers like 10:15") from None
    if not 1 <= start < stop:
        raise ConfigError(f"{named('profile', text)}: expected 1 <= START < STOP")
    return start, stop


def flag(name: str) -> str:
    """The command-line flag of a RunConfig field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")

