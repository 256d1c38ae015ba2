"""The exception types for bad user input (the CLI prints each as one line), the line for a missing extra, and
how a message names a parameter (``named``: ``workers=-1`` to a Python caller, ``--workers -1`` on a command
line)."""

import contextlib
import importlib


class ConfigError(ValueError):
    """A setting the user can fix (device count, batch size, flag, missing data).

    The message says what to do. Experiments print it as one line and exit
    with ``EXIT_CODE`` (2) instead of showing a traceback.
    """

    EXIT_CODE = 2


class Diverged(ConfigError):
    """The loss (outside fp16's skipped steps), the evaluation's loss or the parameters became NaN or infinite.

    Experiments print it as one line and exit with ``EXIT_CODE`` (3), not 2: a sweep tells a diverged trial (a
    normal outcome of its settings) from a usage error (every trial would fail alike) by it.
    """

    EXIT_CODE = 3

    def __init__(self, what: str, step: int, note: str = ""):
        self.what, self.step = what, step
        super().__init__(f"{what} at step {step}: training diverged (a learning rate too high for this model? "
                         f"lower {named('lr')}; or labels outside the model's classes); stopped, nothing past the "
                         "previous checkpoint was saved" + (f"; {note}" if note else ""))


# The optional packages (pyproject.toml's optional-dependencies): the module a feature imports -> the distribution
# and the extra that installs it. `pip install jaxtrain` is the core: training, the built-in datasets, checkpoints.
EXTRAS = {"PIL": ("Pillow", "images"), "matplotlib": ("matplotlib", "plots"),
          "tensorboard": ("tensorboard", "tensorboard"), "qwix": ("qwix", "quantize"), "optuna": ("optuna", "sweep"),
          "safetensors": ("safetensors", "pretrained"), "wandb": ("wandb", "wandb"),
          "mlflow": ("mlflow-skinny", "mlflow"), "tokenizers": ("tokenizers", "text")}


class MissingExtra(ConfigError):
    """A feature's optional package is not installed: the message says which extra installs it (exit 2)."""

    def __init__(self, module: str, what: str):
        self.package, self.extra = EXTRAS[module.split(".")[0]]
        super().__init__(f"{what} needs {self.package}, which is not installed: pip install 'jaxtrain[{self.extra}]'")


def need(module: str, what: str):
    """``module`` imported (``"optuna"``, ``"PIL.Image"``), or a MissingExtra saying that ``what`` (the feature, as
    the user asked for it) needs it. A package that is there but fails to import for another reason raises its own
    error."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:  # a module of the package, or one it needs: a broken install
            raise
        raise MissingExtra(module, what) from None


def missing(module: str, what: str) -> str | None:
    """None when ``module`` imports; else the line a run says as it goes on without ``what`` (a view of the run:
    its curves, its TensorBoard events)."""
    try:
        need(module, what)
    except MissingExtra as e:
        return f"{what} left out: {e.package} is not installed (pip install 'jaxtrain[{e.extra}]')"
    return None


# name -> flag while a command line speaks (``flags_spoken``); None: a Python caller's names. Set by the command's
# entry point around the whole command (its errors and log lines are made in any thread), so a module's.
_FLAGS: dict[str, str] | None = None


def named(name: str, *value, setting: str | None = None) -> str:
    """A parameter as a message names it: ``named("workers", -1)`` is ``workers=-1`` to a Python caller and
    ``--workers -1`` on a command line (``flags_spoken``); ``named("out")`` is ``out=`` or ``--out``; a switch's
    ``named("resume", True)`` is ``resume=True`` or ``--resume``. ``setting``: the command line's name for it where
    the function's parameter has another (``named("schedule", x, setting="pipeline_schedule")``). A name the
    command has no flag for stays as Python says it."""
    flag = (_FLAGS or {}).get(setting or name)
    if flag is None:
        return f"{name}={value[0]}" if value else f"{name}="
    return flag if not value or value[0] is True else f"{flag} {value[0]}"


@contextlib.contextmanager
def flags_spoken(flags: dict[str, str] | None):
    """While a command runs: ``named`` says the parameters in ``flags`` (name -> its flag) as flags; nested, the
    outer command's flags win (its own spellings: ``--student``); ``None``: Python's names meanwhile (what a run
    writes to its files reads the same whoever started it)."""
    global _FLAGS
    before = _FLAGS
    _FLAGS = None if flags is None else {**flags, **(_FLAGS or {})}
    try:
        yield
    finally:
        _FLAGS = before


def spoken() -> dict[str, str] | None:
    """The flags ``named`` says now (None: Python's names): for a worker process to speak as its parent does."""
    return _FLAGS


def speak(flags: dict[str, str] | None) -> None:
    """This whole process names parameters by ``flags`` (a worker process, with its parent's ``spoken()``)."""
    global _FLAGS
    _FLAGS = flags
