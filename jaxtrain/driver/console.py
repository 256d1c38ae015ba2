"""What a run says, as a terminal shows it: the library's log records as plain lines.

The library logs through ``logging`` only, each module to its own logger under
``jaxtrain`` (``jaxtrain.data.loader``, ``jaxtrain.driver.runner``, ...): the
run's progress as INFO, what went wrong as WARNING or ERROR. ``lines()`` shows
them while a run or a command is going on, as they always looked:

    epoch 1/10: train loss 0.5311, ...           INFO, on stdout, as it is
    warning: the index of ... cannot be kept     WARNING, on stderr
    error: process 1 ...: no train step ...      ERROR, on stderr

A caller routes or silences them with ``logging`` as usual: a handler of its
own on the ``jaxtrain`` logger (then ``lines()`` adds none), or that logger's
level (``logging.getLogger("jaxtrain").setLevel(logging.WARNING)``: no
progress lines).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable

ROOT = "jaxtrain"


class Lines(logging.Handler):
    """A record as one plain line (or a block, for a table): INFO as it is on stdout, higher levels on stderr after
    their level's name (``warning: ...``); ``words`` says the parameters the text names (the command line: as
    flags). The streams are looked up when a record comes, so a redirected or captured stdout gets it."""

    def __init__(self, words: Callable[[str], str] = str):
        super().__init__(logging.INFO)
        self.words = words

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.words(record.getMessage())
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            if record.levelno >= logging.WARNING:
                text = f"{record.levelname.lower()}: {text}"
            stream.write(text + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def lines(words: Callable[[str], str] = str):
    """While it lasts, the ``jaxtrain`` logger's records are shown as ``Lines``, INFO and up, and only there (not
    again by a handler on the root logger: absl's, tfds', a test runner's). Unless the logger has a handler
    already (a caller's own, or an outer command's ``lines``): then nothing changes. A level the caller set is
    kept."""
    logger = logging.getLogger(ROOT)
    if logger.handlers:
        yield
        return
    handler, propagate, level = Lines(words), logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    if level == logging.NOTSET:  # else the root logger's WARNING would hide the progress
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate, logger.level = propagate, level
        logger.setLevel(level)
