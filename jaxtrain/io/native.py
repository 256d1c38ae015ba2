"""Compiling a C++ source of jaxtrain's once into a cache, and loading it (oneDNN's convolutions, the JPEG
region decoder).

One library per key (the source, and what else picks its build): ``CACHE/PREFIX-KEY.so``, compiled with g++
(``$CXX``) under a lock, renamed into place whole, its sha256 in ``PREFIX-KEY.sha256`` beside it. A cached
library that does not match its digest or does not load is rebuilt once, saying so in one line; a cache
directory that cannot be written is left for a temporary one (this process only), saying so in one line. Every
other failure is an ``Unusable``: a short cause (a run's first line says it) and the fix.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from jaxtrain import settings
from jaxtrain.io.files import atomic_write

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 600  # g++ takes ~5 s here; a machine 100x busier still finishes
INSTALL_CXX = "install g++ (make onednn; Debian: apt-get install g++)"


class Unusable(OSError):
    """Why a native library cannot be used here: ``cause`` (short: a run's first line names it) and ``fix``
    (what to do); ``str()`` is both, one line."""

    def __init__(self, cause: str, fix: str):
        super().__init__(f"{cause}: {fix}")
        self.cause, self.fix = cause, fix


def note(text: str) -> None:
    """A warning, logged by process 0 only (every process of a run would say the same)."""
    import jax

    if jax.process_index() == 0:
        log.warning(text)


@dataclasses.dataclass(frozen=True)
class Native:
    """A library compiled from ``source``: ``short`` and ``what`` name it in messages; ``command(compiler, out)``
    is the build line; ``key()`` what else picks the build (versions, layout); ``cache`` the setting naming the
    cache directory; ``fix(first_error_line)`` what to install when the build fails; ``rebuild`` the command
    that builds it by hand; ``absent()``: an Unusable before any compiler is tried (a library it links against is
    not installed), or None."""

    short: str
    what: str
    prefix: str
    source: Path
    command: Callable[[str, Path], list[str]]
    key: Callable[[], str]
    cache: str
    fix: Callable[[str], str]
    rebuild: str
    absent: Callable[[], Unusable | None] = lambda: None

    def cache_dir(self) -> Path:
        return getattr(settings.current(), self.cache)

    def name(self) -> str:
        """PREFIX-KEY.so: KEY from the source, ``key()`` and the build flags (not the compiler's path)."""
        flags = self.command("CXX", Path("OUT"))[1:]
        digest = hashlib.sha256(self.source.read_bytes() + f"{self.key()} {flags}".encode()).hexdigest()[:16]
        return f"{self.prefix}-{digest}.so"

    def build(self, rebuild: str | None = None) -> Path:
        """The compiled library, built now if the cache has none that is intact (or ``rebuild``: the digest of
        the cached one that must go); ``Unusable`` where it cannot be."""
        from jaxtrain.io.dirlock import DirLock

        lib = self.cache_dir() / self.name()
        if rebuild is None and intact(lib):
            return lib
        if (why := self.absent()) is not None:
            raise why
        compiler = shutil.which(settings.cxx())
        if compiler is None:
            raise Unusable(f"no C++ compiler found ({settings.cxx()})", INSTALL_CXX)
        if (error := _writable(lib.parent)) is not None:
            private = _private_dir(self.cache.removesuffix("_cache"))
            note(f"cannot write the {self.short} cache {lib.parent} ({error.strerror or error}): building "
                 f"{self.what} in {private} for this process only (a build each start); set "
                 f"${settings.VARIABLES[self.cache]} to a writable directory")
            lib = private / lib.name
        with DirLock(lib.parent, settings.VARIABLES[self.cache], name=".build.lock",
                     waiting=f"waiting for another build of {self.what}"):
            if intact(lib) and (rebuild is None or _sha256(lib) != rebuild):  # another process rebuilt it meanwhile
                return lib
            if rebuild is None and lib.exists():
                note(f"the cached {lib} does not match its digest ({_digest_file(lib).name}): rebuilding it")
            self._compile(compiler, lib)
        return lib

    def _compile(self, compiler: str, lib: Path) -> None:
        """``lib`` and its digest, whole or absent (a build cut short leaves no half-written library)."""
        tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
        try:
            done = subprocess.run(self.command(compiler, tmp), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            tmp.unlink(missing_ok=True)
            raise Unusable(f"build failed: g++ took over {BUILD_TIMEOUT_S} s", f"run {self.rebuild} once the "
                           "machine is less busy") from None
        if done.returncode:
            tmp.unlink(missing_ok=True)
            lines = done.stderr.splitlines()
            errors = ([line for line in lines if "fatal error" in line or "cannot find" in line]
                      or [line for line in lines if "error" in line] or lines)
            first = (errors or [f"{compiler} exited {done.returncode}"])[0].strip()
            raise Unusable(f"build failed: {first}", self.fix(first))
        digest = _sha256(tmp)
        os.replace(tmp, lib)
        atomic_write(_digest_file(lib), digest + "\n")  # a library without its digest is rebuilt, never trusted

    def load(self) -> ctypes.CDLL:
        """The library, loaded: a cached one that does not load is rebuilt once (saying so); ``Unusable`` if it
        still cannot be loaded."""
        lib = self.build()
        try:
            return ctypes.CDLL(str(lib))
        except OSError as e:
            note(f"the cached {lib} does not load ({e}): rebuilding it")
            lib = self.build(rebuild=_sha256(lib))
        try:
            return ctypes.CDLL(str(lib))
        except OSError as e:
            raise Unusable(f"build failed: the library does not load ({e})",
                           f"delete {lib.parent} and run {self.rebuild}") from None


def _digest_file(lib: Path) -> Path:
    return lib.with_suffix(".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact(lib: Path) -> bool:
    """Whether ``lib`` is there and matches the digest written beside it when it was built."""
    try:
        return _digest_file(lib).read_text().strip() == _sha256(lib)
    except OSError:
        return False


def _writable(directory: Path) -> OSError | None:
    """None if files can be made in ``directory`` (created if missing); else the error that says why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            return None
    except OSError as e:
        return e


def _private_dir(prefix: str) -> Path:
    """A temporary directory of this process's own, removed when it exits."""
    path = Path(tempfile.mkdtemp(prefix=f"jaxtrain-{prefix}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
