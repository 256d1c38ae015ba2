"""The command line of a training run: flags <-> RunConfig, and ``main`` with its exit codes; and those of a
finished run: ``sample`` (text from a language model's), ``export`` (its model as PyTorch's libraries load it).

    python -m experiments.lenet --devices 2      # = jaxtrain.cli.main("lenet")

Every flag is a RunConfig field (its help and check come from there);
``to_argv`` writes a config back as flags (``parse(to_argv(c)) == c``).
The library's messages name parameters with ``errors.named`` (``workers=0``, ``pass checkpoint_dir=``, as a
Python user calls them); while a command runs (``library_log``) they name its flags instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
from collections.abc import Mapping, Sequence

from jaxtrain.choices import MESH_AXES
from jaxtrain import errors
from jaxtrain.errors import ConfigError
from jaxtrain.models import MODELS
from jaxtrain.io import console
from jaxtrain.driver.config import DATASET_FIELDS, RECIPE_FIELDS, TEXT_FIELDS, RunConfig, flag
from jaxtrain.driver.sections import FIELDS, ORDER, SECTIONS


def whole_number(minimum: int):
    """argparse type: a whole number >= ``minimum`` (a one-line error otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value}")
        return value

    return parse


positive_int = whole_number(1)


def whole_numbers(minimum: int, example: str):
    """argparse type: comma-separated whole numbers >= ``minimum``, like ``example`` (a one-line error otherwise)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers like {example}, got "
                                             f"{text!r}") from None
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected numbers >= {minimum} like {example}, got {text!r}")
        return values

    return parse


def executable(text: str) -> str:
    """argparse type: a program that can be run (a path, or a name on $PATH)."""
    import shutil

    if shutil.which(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a program that can be run: give a path to one")
    return text


def setting_flags(flags: dict[str, str] | None = None) -> dict[str, str]:
    """Every RunConfig setting's flag by its name (``batch_size`` -> ``--batch-size``), and ``flags``: more names a
    command spells its own way (``{"budget_bytes": "--memory-budget"}``)."""
    return {**{name: flag(name) for name in FIELDS}, **(flags or {})}


@contextlib.contextmanager
def library_log(flags: dict[str, str] | None = None):
    """While a command runs: the library's log lines (``io.console.lines``: progress on stdout, ``warning: ...`` on
    stderr), and its messages naming parameters as flags (``errors.named``: ``--on-bad-image error``, not
    ``on_bad_image=error``; ``flags``: as ``setting_flags``)."""
    with errors.flags_spoken(setting_flags(flags)), console.lines():
        yield


def one_line_errors(prog: str, flags: dict[str, str] | None = None):
    """Decorator of a command's ``main(argv)``: a ConfigError becomes ``prog: error: ...`` on stderr (``prog``: or
    the one ``main`` is called with; its parameters named as flags: ``library_log``), exit with its ``EXIT_CODE``
    (2; a Diverged run: 3)."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None, **kwargs) -> int:
            try:
                with library_log(flags):
                    return main(argv, **kwargs)
            except ConfigError as e:
                print(f"{kwargs.get('prog') or prog}: error: {e}", file=sys.stderr)
                return e.EXIT_CODE

        return run

    return wrap


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=2"`` -> ``{"data": 2, "model": 2}`` (``--mesh``); ConfigError if malformed."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit() or name.strip() in axes:
            raise ConfigError(f"--mesh {text!r}: write axis sizes as name=N separated by commas, e.g. data=2,model=2")
        axes[name.strip()] = int(size)
    unknown = [name for name in axes if name not in MESH_AXES]
    if unknown:
        raise ConfigError(f"--mesh {text!r}: unknown axis {unknown[0]!r}; the axes a run uses are "
                          f"{', '.join(MESH_AXES)} (e.g. data=2,model=2 or data=1,stage=4)")
    return axes


def _mesh(text: str) -> dict[str, int]:
    try:
        return parse_mesh(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _flag_type(f: dataclasses.Field):
    if f.metadata["flag_type"] == "mesh":
        return _mesh
    if f.type.startswith("int"):
        return int
    if f.type.startswith("float"):
        return _number
    return str


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """--help's defaults, each said once: none added for None (the flag's help says what it means: "default:
    mini") or a switch's False; a value is (a model's recipe: "the model's recipe) (default: 10")."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


# A fixed model's --help leaves out the flags its kind refuses (driver.config says why, if given).
TEXT_ONLY = (*TEXT_FIELDS, "rotary")
IMAGES_ONLY = ("data_dir", "tfds_dir", "classes", "image_size", "on_bad_image", "augment", "quantize")


def make_parser(model: str | None = None, description: str | None = None, prog: str | None = None,
                fields: Sequence[str] | None = None,
                renamed: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Flags of every RunConfig field (or of ``fields``); ``model`` fixes the model (its recipe gives the
    defaults shown); ``renamed``: a field's flag under another name (experiments.distill: model -> --student)."""
    renamed = renamed or {}
    prog = prog or (f"python -m experiments.{model}" if model else "python -m jaxtrain.cli")
    defaults = RunConfig(model=model or "lenet")
    p = argparse.ArgumentParser(prog=prog, description=description or (MODELS[model].description if model else None),
                                formatter_class=DefaultsOnce, allow_abbrev=False)  # --epoch is no --epochs
    groups = {}

    def group(attr: str) -> argparse._ArgumentGroup:  # --help's: the flags by section, one made with its first flag
        if attr not in groups:
            groups[attr] = p.add_argument_group(attr, SECTIONS[attr].__doc__)
        return groups[attr]

    hidden = () if model is None else TEXT_ONLY if not MODELS[model].text else IMAGES_ONLY
    for section, f in FIELDS.values():
        if model and (f.name == "model" or f.name == "init" and len(MODELS[model].inits) == 1):
            continue
        if fields is not None and f.name not in fields:
            continue
        meta, default = f.metadata, getattr(defaults, f.name)
        if model is None and f.name in (*RECIPE_FIELDS, "init", "dataset") or f.name in DATASET_FIELDS:
            default = None  # the --model (its recipe) or the --dataset given picks them, not lenet's or the default's
        name = renamed.get(f.name, flag(f.name))
        helped = argparse.SUPPRESS if f.name in hidden else meta["help"]  # parsed still: refused in one line
        if f.type == "bool":
            group(section).add_argument(name, dest=f.name, action="store_true", help=helped)
            continue
        metavar = {"mesh": "data=N[,model=M]", "steps": "START:STOP"}.get(meta["flag_type"])
        choices = meta["choices"] or (MODELS[model].inits if model and f.name == "init" else None)
        group(section).add_argument(name, dest=f.name, type=_flag_type(f), default=default, choices=choices,
                                    metavar=metavar, help=helped)
    if model:
        p.set_defaults(model=model)
        p.epilog = (f"{'an image' if hidden is TEXT_ONLY else 'a language'} model's: the flags of "
                    f"{'language models' if hidden is TEXT_ONLY else 'images'} are not listed "
                    "(python -m jaxtrain.cli --help lists every flag)")
    return p


def parse(argv: Sequence[str] | None = None, model: str | None = None) -> RunConfig:
    """The RunConfig the flags say (argparse exits 2 on a malformed value; ConfigError on a bad one)."""
    return RunConfig(**vars(make_parser(model).parse_args(argv)))


def to_argv(config: RunConfig, model_fixed: bool = True) -> list[str]:
    """Flags that give ``config`` back from ``parse(..., model=config.model)`` (defaults left out)."""
    argv = [] if model_fixed else ["--model", config.model]
    # the dataset against the default; the rest against the defaults for its dataset (a folder's augment and
    # image_size are not the others'), text's against those of its model size and tokenizer (seq_len, vocab_size)
    text = {k: getattr(config, k) for k in ("model_size", "tokenizer") if getattr(config, k) is not None}
    plain, bare = RunConfig(model=config.model), RunConfig(model=config.model, dataset=config.dataset)
    base = RunConfig(model=config.model, dataset=config.dataset, **text) if text else bare
    for f in (FIELDS[name][1] for name in ORDER):  # in the order a sweep's stored command has them
        value = getattr(config, f.name)
        against = plain if f.name == "dataset" else bare if f.name in text else base
        if f.name == "model" or value == getattr(against, f.name):
            continue
        if f.type == "bool":
            argv.append(flag(f.name))
        elif f.metadata["flag_type"] == "mesh":
            argv += [flag(f.name), ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            argv += [flag(f.name), str(value)]
    return argv


# The modules a training run's command runs (python -m MODULE ...): the model each fixes (None: --model says).
RUNS = {"experiments.lenet": "lenet", "experiments.resnet18": "resnet18", "experiments.vit": "vit",
        "experiments.gpt": "gpt", "experiments.distill": None, "jaxtrain.cli": None}


def run_config(command: Sequence[str], more: Sequence[str] = ()) -> RunConfig:
    """The RunConfig of a training run's command (``python -m MODULE FLAGS``, MODULE one of ``RUNS``) with
    ``more`` flags, parsed and checked as the run does: a one-line ConfigError, before anything runs."""
    module = command[2] if len(command) > 2 and command[1] == "-m" else None
    where = " ".join(command[:3])
    if module not in RUNS:
        raise ConfigError(f"{where}: not a training run; give python -m MODULE with MODULE one of {', '.join(RUNS)}")
    parser = make_parser(RUNS[module], prog=f"python -m {module}",
                         renamed={"model": "--student"} if module == "experiments.distill" else None)

    def error(message):
        raise ConfigError(f"the command {where}: {message} (see {where} --help)")

    parser.error = error
    return RunConfig(**vars(parser.parse_args([*command[3:], *more])))


def main(model: str | None = None, argv: Sequence[str] | None = None, description: str | None = None,
         prog: str | None = None, renamed: Mapping[str, str] | None = None) -> int:
    """Parse, run, and turn user errors into one line on stderr with exit code 2 (3: training diverged).

    SIGTERM / SIGINT are handled from here on (jaxtrain.driver.signals): at start-up
    they exit at once, during training they checkpoint and stop. JAX is
    imported after that.
    """
    from jaxtrain.driver.signals import Exit, StopOnSignal

    with StopOnSignal() as stop, library_log(renamed):  # errors name its flags (distill's --student)
        parser = make_parser(model, description, prog, renamed=renamed)
        args = parser.parse_args(argv)
        try:
            config = RunConfig(**vars(args))
            from jaxtrain.driver.runner import run

            run(config, stop)
        except ConfigError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return e.EXIT_CODE
        except Exit as e:
            return e.code
        except Exception as e:
            if _out_of_memory(e):
                print(f"{parser.prog}: error: out of memory ({str(e).splitlines()[0][:200]}): the step needs more "
                      "than the devices hold; a smaller --batch-size (or --accum-steps), --remat full, --precision "
                      "bf16, or more devices with --param-sharding fsdp", file=sys.stderr)
                return 1
            if not _peer_gone(e):
                raise
            print(f"{parser.prog}: error: a collective failed ({str(e).splitlines()[0][:200]}): another process "
                  "of this run is gone (the launcher's message says which); --resume continues from the last "
                  "checkpoint", file=sys.stderr)
            return 1
    return 0


def _out_of_memory(e: Exception) -> bool:
    """XLA's allocation failure (a step too large for the host's or a GPU's memory): a runtime error, one line."""
    return type(e).__name__ == "JaxRuntimeError" and str(e).startswith("RESOURCE_EXHAUSTED")


def _peer_gone(e: Exception) -> bool:
    """A runtime error of a multi-process run's collective: a peer died (gloo: "Connection closed by peer")."""
    jax = sys.modules.get("jax")
    return (jax is not None and type(e).__name__ == "JaxRuntimeError" and jax.distributed.is_initialized()
            and jax.process_count() > 1)


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number >= 0 (0: greedy)")
    return value


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("'': empty; leave --prompt out to start from a new line")
    return text


@one_line_errors("jaxtrain sample", {"run_dir": "RUN_DIR"})
def sample(argv: Sequence[str] | None = None, prog: str = "jaxtrain sample") -> int:
    """``jaxtrain sample RUN_DIR`` (``python -m experiments.sample``); JAX is imported after the flags are read."""
    p = argparse.ArgumentParser(prog=prog, description="Text from a finished language-model run (jaxtrain gpt --out "
                                "RUN_DIR): its saved model and tokenizer, a prompt, and new tokens sampled one by one "
                                "with a KV cache (jaxtrain.models.generate; one compiled call).",
                                formatter_class=DefaultsOnce, allow_abbrev=False)
    p.add_argument("run_dir", help="a finished language-model run's --out directory (model/, model.json, "
                                   "tokenizer.json)")
    p.add_argument("--prompt", type=_prompt, help="the text to go on from (default: a new line; at "
                                                                "most half the model's context is kept: its end)")
    p.add_argument("--tokens", type=whole_number(1), default=100,
                   help="new tokens to sample (the text stops at the model's context, --seq-len tokens)")
    p.add_argument("--temperature", type=_temperature, default=0.8, help="softmax temperature; 0: greedy")
    p.add_argument("--top-k", type=whole_number(1), default=40, help="sample among the k most likely tokens only")
    p.add_argument("--samples", type=whole_number(1), default=1, help="how many continuations (seeds seed, "
                                                                      "seed + 1, ...)")
    p.add_argument("--seed", type=whole_number(0), default=0, help="the first sample's key")
    args = p.parse_args(argv)

    from jaxtrain.driver import language

    model, params, tokenizer = language.trained(args.run_dir)
    prompt = "\n" if args.prompt is None else args.prompt
    for text in language.samples(model, params, tokenizer, [prompt] * args.samples, args.tokens, seed=args.seed,
                                   temperature=args.temperature, top_k=None if args.temperature == 0 else args.top_k):
        print(text)
        if args.samples > 1:
            print("-" * 40)
    return 0


@one_line_errors("jaxtrain export", {"run_dir": "RUN_DIR", "names": "--names"})
def export(argv: Sequence[str] | None = None, prog: str = "jaxtrain export") -> int:
    """``jaxtrain export RUN_DIR FILE`` (``python -m experiments.export_weights``): a finished run's model as a file
    torchvision, timm or transformers load (``jaxtrain.driver.export.save_pretrained``; docs/pretrained.md)."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, description="A finished run's model as a file "
                                "torchvision, timm or transformers load (docs/pretrained.md).")
    p.add_argument("run_dir", help="a finished run's --out directory (holding model/ and model.json)")
    p.add_argument("file", help="where to write: NAME.safetensors, or NAME.pth (needs torch)")
    p.add_argument("--names", choices=("torchvision", "timm", "hf", "hf4"),
                   help="whose tensor names (default: torchvision's for a ResNet, timm's for a ViT, Hugging Face's "
                        "GPT-2 for a GPT; hf: a ViT as transformers 5's ViTForImageClassification, hf4: as "
                        "transformers 4's, the Hub's files)")
    args = p.parse_args(argv)
    from jaxtrain.driver.export import save_pretrained

    print(f"wrote {save_pretrained(args.run_dir, args.file, names=args.names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
