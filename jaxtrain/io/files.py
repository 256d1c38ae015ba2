"""Files a run writes, whole or not at all: atomic writes, digests, room on the disk.

The loop, the checkpoints, the export and the run's outputs depend on this
module; it depends on nothing of jaxtrain but its error type.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

from jaxtrain.errors import ConfigError


def params_digest(params) -> str:
    """sha256 of the params' bytes, leaves in tree order (dict keys sorted)."""
    h = hashlib.sha256()
    if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(params)):
        from jax.experimental import multihost_utils  # sharded over processes: every process gets the whole

        params = multihost_utils.process_allgather(params, tiled=True)
    for leaf in jax.tree.leaves(jax.device_get(params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def ensure_writable(path: Path, what: str, param: str) -> Path:
    """Create ``path`` and prove it writable now, not after an hour of training."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{jax.process_index()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write {what} {path} ({e.strerror}); pass {param} somewhere writable") from None
    return path


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` (an OSError, or a library's wrapped error) says the disk is full."""
    text = str(e)
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        s in text for s in ("No space left", "ENOSPC", "RESOURCE_EXHAUSTED", "Disk quota exceeded"))


# A tensorstore error as orbax passes it on: an absl status code, then the message ("OUT_OF_RANGE: Error reading ...").
_STATUS = re.compile(r"^(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
                     r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|UNIMPLEMENTED|"
                     r"INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): ")


class _DropLateTaskReports(logging.Filter):
    """asyncio's reports of a task whose exception nobody retrieved, where the task ran one of tensorstore's
    futures (an awaitable that is no coroutine: asyncio wraps it in ``_wrap_awaitable``) and its exception is a
    tensorstore error (an absl status code first). A coroutine's task, a user's, is never dropped: JAX's own
    errors read "RESOURCE_EXHAUSTED: ..." too."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        return not (text.startswith("Task exception was never retrieved") and "_wrap_awaitable" in text
                    and _STATUS.match(str(exc or "")))


def drop_late_read_reports() -> None:
    """From now on, drop the late reports of a failed orbax read or write (and only those).

    When an orbax read or write fails, tensorstore's operations still in flight fail or call back after the first
    failure reached us, with our one-line error already said:
    - into the asyncio loop orbax has already closed: Python prints each ``RuntimeError('Event loop is closed')`` as
      an unraisable traceback with no header;
    - as tasks whose tensorstore error nobody retrieves: asyncio logs "Task exception was never retrieved" with a
      traceback when they are collected (seen on Python 3.13, under load).
    They can come before the failure reaches us, so install this before any orbax call, not in its ``except``.
    Installing it twice is installing it once.
    """
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropLateTaskReports) for f in asyncio_log.filters):
        asyncio_log.addFilter(_DropLateTaskReports())
    if getattr(sys.unraisablehook, "drops_closed_loop", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook


def ensure_room(path: Path, needed: int, what: str, param: str) -> None:
    """A one-line error now if ``path``'s file system has less than ``needed`` bytes free."""
    free = shutil.disk_usage(path).free
    if free < needed:
        raise ConfigError(f"{path} has {free / 2**20:.1f} MiB free but the run will write about "
                          f"{needed / 2**20:.1f} MiB of {what} there: make room, or pass {param} elsewhere")


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``path`` whole or not at all: a temp file in the same directory, fsync'd, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_temps(directory: Path) -> None:
    """Delete ``atomic_write`` temp files whose writer is dead (a SIGKILL mid-write leaves one; nothing can
    clean up then, so the next run in the directory does)."""
    for tmp in directory.glob(".*.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
        except ValueError:
            continue  # not ours
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's
