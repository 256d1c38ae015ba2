"""Keep freed host memory in the process on CPU runs, so a step does not page-fault its buffers in again each time.

XLA:CPU allocates each step's temporaries (hundreds of MB for ResNet-18) with malloc and frees them at the end of
the step. glibc serves blocks that large with a fresh mmap and unmaps them on free, so every step takes page
faults on all of it, and the kernel zeroes every page (docs/performance.md, "Host memory", has the counts).
Keeping freed blocks in one heap, as a caching allocator does, takes that to 0.

``keep_freed_memory()`` sets glibc's malloc so (``mallopt``): one arena for every thread (``M_ARENA_MAX``; a
thread's own arena would hand large blocks back to the system), no mmap'd blocks (``M_MMAP_MAX``; glibc still
maps when the heap cannot grow), and no trimming of the heap's free top (``M_TRIM_THRESHOLD`` -1: mallopt(3)'s
"disables trimming completely"; a threshold of 2 GiB, the largest positive C int, was trimmed now and then by a
process holding two large programs, the GPT's step and a second one, and the next steps
page-faulted the top in again). The cost: memory freed stays in the process for it to use again, so the process's
memory never goes down (it keeps its peak heap until it exits: a notebook's kernel too;
``ctypes.CDLL(None).malloc_trim(0)`` hands it back after a large phase), and one heap fragments, so a run holds
more than its peak with glibc's defaults (steady after a few steps; measured in the same section).
``setup_devices`` calls it before JAX starts, on CPU only; $JAXTRAIN_MALLOC=default keeps glibc's defaults (any
other value but empty is a ConfigError: a misspelt opt-out must not keep the settings silently).
"""

from __future__ import annotations

import ctypes
import platform
import sys


# glibc's <malloc.h> parameter, its environment variable, and what jaxtrain sets it to (mallopt takes a C int;
# a trim threshold of -1 is SIZE_MAX to a 64-bit glibc, through mallopt and through the variable alike: never
# reached).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_TABLE = ((M_ARENA_MAX, "MALLOC_ARENA_MAX", 1), (M_MMAP_MAX, "MALLOC_MMAP_MAX_", 0),
          (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", -1))
SETTINGS = {param: value for param, _, value in _TABLE}
# The same as environment variables, for a process started from outside (the PyTorch worker of experiments.bench).
ENV_SETTINGS = {name: str(value) for _, name, value in _TABLE}

_applied = False


def glibc() -> bool:
    """True where this process runs on glibc (Linux, not musl), the malloc these settings are for."""
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def wanted() -> bool:
    """Whether ``keep_freed_memory`` sets anything here: glibc, and $JAXTRAIN_MALLOC unset (or empty), not
    "default"; any other value is a ConfigError (``jaxtrain.settings``)."""
    from jaxtrain import settings

    return glibc() and settings.current().malloc == "keep"


def keep_freed_memory() -> bool:
    """Apply ``SETTINGS`` with glibc's ``mallopt``; True if they are in force (now or already), False where they
    do not apply (not glibc, or $JAXTRAIN_MALLOC=default). Call before threads start: a thread that already has
    an arena of its own keeps it."""
    global _applied
    if _applied:
        return True
    if not wanted():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
    return _applied


def applied() -> bool:
    """Whether ``keep_freed_memory`` set glibc's malloc in this process."""
    return _applied
