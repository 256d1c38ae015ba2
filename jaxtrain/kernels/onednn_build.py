"""Compiling oneDNN's convolutions (``onednn_conv.cc``) once into a cache, and loading them.

One library per source, jaxlib and oneDNN: ``$JAXTRAIN_ONEDNN_CACHE/conv-KEY.so`` (default
``~/.cache/jaxtrain/onednn``), compiled with g++ (``$CXX``) against the pip-installed oneDNN 3.2
(``onednn-cpu-gomp``, a requirement on x86-64 Linux) or else the system's (Debian's ``libdnnl-dev``, 2.6), under
a lock, renamed into place whole, its sha256 in ``conv-KEY.sha256`` beside it. A cached library that does not
match its digest or does not load is rebuilt once, saying so in one line; a cache directory that cannot be
written is left for a temporary one (this process only), saying so in one line. Every other failure is an
``Unusable``: a short cause (a run's first line says it) and the fix.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from jaxtrain import settings
from jaxtrain.io.files import atomic_write

SOURCE = Path(__file__).with_name("onednn_conv.cc")
ENV_CACHE = settings.VARIABLES["onednn_cache"]
BUILD_TIMEOUT_S = 600  # g++ takes ~5 s here; a machine 100x busier still finishes
_LAYOUT = "2"  # in the key: libraries with a digest file beside them (older ones are left alone)
INSTALL_CXX = "install g++ (make onednn; Debian: apt-get install g++)"
INSTALL_DNNL = ("install oneDNN (pip install onednn-cpu-gomp onednn-devel-cpu-gomp, as jaxtrain's requirements do "
                "on x86-64 Linux; or apt-get install libdnnl-dev)")


class Unusable(OSError):
    """Why oneDNN's convolutions cannot be used here: ``cause`` (short: a run's first line names it) and ``fix``
    (what to do); ``str()`` is both, one line."""

    def __init__(self, cause: str, fix: str):
        super().__init__(f"{cause}: {fix}")
        self.cause, self.fix = cause, fix


def expected() -> bool:
    """Whether oneDNN's convolutions are expected to build here: x86-64 Linux, where jaxtrain's requirements
    bring oneDNN (elsewhere the system's oneDNN may still do)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def cache_dir() -> Path:
    return settings.current().onednn_cache


def note(text: str) -> None:
    """One line on stderr, on process 0 only (every process of a run would say the same)."""
    if jax.process_index() == 0:
        print(f"warning: {text}", file=sys.stderr, flush=True)


def _wheel_onednn() -> str | None:
    """The prefix of the pip-installed oneDNN (``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp``: oneDNN 3.2,
    headers in PREFIX/include, libdnnl in PREFIX/lib), or None: the system's (Debian's libdnnl-dev, 2.6)."""
    return sys.prefix if (Path(sys.prefix) / "include" / "oneapi" / "dnnl" / "dnnl.hpp").exists() else None


def _command(compiler: str, out: Path) -> list[str]:
    dnnl = _wheel_onednn()
    flags = [f"-I{dnnl}/include", f"-L{dnnl}/lib", f"-Wl,-rpath,{dnnl}/lib"] if dnnl else []
    return [compiler, "-O2", "-shared", "-fPIC", "-fopenmp", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
            *flags, str(SOURCE), "-ldnnl", "-o", str(out)]


def _name() -> str:
    """conv-KEY.so: KEY from the source, jaxlib, and the flags that pick oneDNN (not the compiler's path)."""
    flags = _command("CXX", Path("OUT"))[1:]
    key = hashlib.sha256(SOURCE.read_bytes() + f"{jax.__version__} {_LAYOUT} {flags}".encode()).hexdigest()[:16]
    return f"conv-{key}.so"


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


def _private_dir() -> Path:
    """A temporary directory of this process's own, removed when it exits."""
    path = Path(tempfile.mkdtemp(prefix="jaxtrain-onednn-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def build(rebuild: str | None = None) -> Path:
    """The compiled library, built now if the cache has none that is intact (or ``rebuild``: why the cached one
    must go); ``Unusable`` where it cannot be."""
    from jaxtrain.io.dirlock import DirLock

    lib = cache_dir() / _name()
    if rebuild is None and intact(lib):
        return lib
    compiler = shutil.which(settings.cxx())
    if compiler is None:
        raise Unusable(f"no C++ compiler found ({settings.cxx()})", INSTALL_CXX)
    if (error := _writable(lib.parent)) is not None:
        private = _private_dir()
        note(f"cannot write the oneDNN cache {lib.parent} ({error.strerror or error}): building oneDNN's "
             f"convolutions in {private} for this process only (~5 s each start); set ${ENV_CACHE} to a "
             "writable directory")
        lib = private / lib.name
    with DirLock(lib.parent, ENV_CACHE, name=".build.lock", waiting="waiting for another build of oneDNN's "
                 "convolutions"):
        if intact(lib) and (rebuild is None or _sha256(lib) != rebuild):  # another process rebuilt it meanwhile
            return lib
        if rebuild is None and lib.exists():
            note(f"the cached {lib} does not match its digest ({_digest_file(lib).name}): rebuilding it")
        _compile(compiler, lib)
    return lib


def _compile(compiler: str, lib: Path) -> None:
    """``lib`` and its digest, whole or absent (a build cut short leaves no half-written library)."""
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
    try:
        done = subprocess.run(_command(compiler, tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise Unusable(f"build failed: g++ took over {BUILD_TIMEOUT_S} s", "run python -m jaxtrain.kernels.onednn "
                       "once the machine is less busy") from None
    if done.returncode:
        tmp.unlink(missing_ok=True)
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
        first = (errors or [f"{compiler} exited {done.returncode}"])[0].strip()
        raise Unusable(f"build failed: {first}", INSTALL_DNNL if "dnnl" in first else f"{INSTALL_CXX}; {INSTALL_DNNL}")
    digest = _sha256(tmp)
    os.replace(tmp, lib)
    atomic_write(_digest_file(lib), digest + "\n")  # a library without its digest is rebuilt, never trusted


def load() -> ctypes.CDLL:
    """The library, loaded: a cached one that does not load is rebuilt once (saying so); ``Unusable`` if it
    still cannot be loaded."""
    lib = build()
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        note(f"the cached {lib} does not load ({e}): rebuilding it")
        lib = build(rebuild=_sha256(lib))
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        raise Unusable(f"build failed: the library does not load ({e})",
                       f"delete {lib.parent} and run python -m jaxtrain.kernels.onednn") from None
