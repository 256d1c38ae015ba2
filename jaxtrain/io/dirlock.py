"""One run per directory: an exclusive lock file holding its owner's pid and host.

The lock is a ``flock`` on ``DIR/.lock``, held for the whole run: the kernel
drops it when the owner dies however it dies (SIGKILL included), so a stale
lock never blocks a new run. The file keeps the owner's pid, host and start
time only to say who holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from jaxtrain.errors import ConfigError

log = logging.getLogger(__name__)


class DirLock:
    """``with DirLock(path, param):`` or ``acquire()`` / ``release()``.

    Held by another process: a ConfigError naming ``param`` (the parameter that chose the directory, e.g.
    "out="); or, given ``waiting`` (a message), that message on stderr and a wait for the holder to finish.
    ``name``: the lock file's name in ``directory``.
    """

    def __init__(self, directory: Path, param: str, *, name: str = ".lock", waiting: str | None = None):
        self.path = Path(directory) / name
        self.param, self.waiting = param, waiting
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            if self.waiting is not None:
                log.info(f"{self.waiting} ({owner}) ...")
                fcntl.flock(fd, fcntl.LOCK_EX)
                return self._own(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent} is in use by another run ({owner}); wait for it to finish, "
                f"or pass another {self.param}") from None
        return self._own(fd)

    def _own(self, fd: int) -> DirLock:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read_owner(fd: int) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {owner['pid']} on {owner['host']} since {owner['since']}"
    except (OSError, ValueError, KeyError):
        return "owner unknown"


@contextlib.contextmanager
def taking_turns(path: Path):
    """Processes that run the block on one file at once take turns: an exclusive ``flock`` on ``path`` itself (made
    empty if missing, its contents untouched). On a SQLite file it never meets SQLite's own locks (POSIX record
    locks): two processes making one database's tables at once (Optuna's, MLflow's) failed with "table ... already
    exists"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:  # an empty file is an empty database to SQLite
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
