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
progress lines). While ``lines()`` shows them they do not also reach the root
logger's handlers (absl and tfds install some, which would say each twice).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
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


_lock = threading.Lock()
_shown: dict = {}  # while ``lines`` shows the records: its handler, the logger's propagate and level before, users


@contextlib.contextmanager
def lines(words: Callable[[str], str] = str):
    """While it lasts, the ``jaxtrain`` logger's records are shown as ``Lines``, INFO and up, and only there (not
    again by a handler on the root logger: absl's, tfds', a test runner's). Unless the logger has a handler of
    someone else's (a caller's own): then nothing changes. Nested or in threads at once, the first one's handler
    serves all, until the last ends. A level the caller set is kept."""
    logger = logging.getLogger(ROOT)
    with _lock:
        ours = bool(_shown) or not logger.handlers
        if _shown:
            _shown["users"] += 1
        elif ours:
            _shown.update(handler=Lines(words), propagate=logger.propagate, level=logger.level, users=1)
            logger.addHandler(_shown["handler"])
            logger.propagate = False
            if logger.level == logging.NOTSET:  # else the root logger's WARNING would hide the progress
                logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        if ours:
            with _lock:
                _shown["users"] -= 1
                if not _shown["users"]:
                    logger.removeHandler(_shown["handler"])
                    logger.propagate = _shown["propagate"]
                    logger.setLevel(_shown["level"])
                    _shown.clear()


def shown(fn: Callable) -> Callable:
    """``fn`` under ``lines()``: a library call a user makes alone, outside a run (``jt.setup_devices``, a
    dataset's load), says its lines too (waiting for peers, converting a dataset once, ...)."""

    @functools.wraps(fn)
    def said(*args, **kwargs):
        with lines():
            return fn(*args, **kwargs)

    return said


def exit_now(code: int) -> None:
    """End the process at once (``os._exit``: no clean-up, no thread waited for), once every log handler has
    written what it holds (a caller's may buffer): the last line before the exit is not lost."""
    logging.shutdown()
    os._exit(code)
