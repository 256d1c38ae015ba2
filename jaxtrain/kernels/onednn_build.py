"""Compiling oneDNN's convolutions (``onednn_conv.cc``) once into a cache, and loading them.

One library per source, jaxlib and oneDNN: ``$JAXTRAIN_ONEDNN_CACHE/conv-KEY.so`` (default
``~/.cache/jaxtrain/onednn``), compiled with g++ (``$CXX``) against the pip-installed oneDNN 3.2
(``onednn-cpu-gomp``, the ``cpu-conv`` extra on x86-64 Linux) or else the system's (Debian's ``libdnnl-dev``, 2.6); the
cache, its digests and what goes wrong are ``jaxtrain.io.native``'s.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import jax

from jaxtrain import settings
from jaxtrain.io import native
from jaxtrain.io.native import INSTALL_CXX, Unusable, intact, note  # noqa: F401  (the names they were here)

SOURCE = Path(__file__).with_name("onednn_conv.cc")
_LAYOUT = "2"  # in the key: libraries with a digest file beside them (older ones are left alone)
INSTALL_DNNL = "pip install 'jaxtrain[cpu-conv]' (x86-64 Linux), or apt-get install libdnnl-dev"


def expected() -> bool:
    """Whether oneDNN's convolutions are expected to build here: x86-64 Linux, where jaxtrain's cpu-conv extra
    bring oneDNN (elsewhere the system's oneDNN may still do)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _wheel_onednn() -> str | None:
    """The prefix of the pip-installed oneDNN (``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp``: oneDNN 3.2,
    headers in PREFIX/include, libdnnl in PREFIX/lib), or None: the system's (Debian's libdnnl-dev, 2.6)."""
    return sys.prefix if (Path(sys.prefix) / "include" / "oneapi" / "dnnl" / "dnnl.hpp").exists() else None


def _command(compiler: str, out: Path) -> list[str]:
    dnnl = _wheel_onednn()
    flags = [f"-I{dnnl}/include", f"-L{dnnl}/lib", f"-Wl,-rpath,{dnnl}/lib"] if dnnl else []
    return [compiler, "-O2", "-shared", "-fPIC", "-fopenmp", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
            *flags, str(SOURCE), "-ldnnl", "-o", str(out)]


SYSTEM_INCLUDES = ("/usr/include", "/usr/local/include")  # Debian's libdnnl-dev; a build from source


def _not_installed() -> Unusable | None:
    """oneDNN's header nowhere a compiler looks by default, nor where the cpu-conv extra puts it: not installed."""
    places = [Path(sys.prefix) / "include", *map(Path, SYSTEM_INCLUDES),
              *map(Path, settings.include_path())]
    if any((place / "oneapi" / "dnnl" / "dnnl.hpp").exists() for place in places):
        return None
    return Unusable("oneDNN is not installed", INSTALL_DNNL)


LIBRARY = native.Native(
    short="oneDNN", what="oneDNN's convolutions", prefix="conv", source=SOURCE, command=_command,
    key=lambda: f"{jax.__version__} {_LAYOUT}", cache="onednn_cache",
    fix=lambda error: INSTALL_DNNL if "dnnl" in error else f"{INSTALL_CXX}; {INSTALL_DNNL}",
    rebuild="python -m jaxtrain.kernels.onednn", absent=lambda: _not_installed())
build, load = LIBRARY.build, LIBRARY.load


def cache_dir() -> Path:
    return LIBRARY.cache_dir()
