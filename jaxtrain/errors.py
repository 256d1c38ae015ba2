"""The one exception type for bad user input: the CLI prints it as one line."""


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
                         "lower lr=; or labels outside the model's classes); stopped, nothing past the previous "
                         "checkpoint was saved" + (f"; {note}" if note else ""))
