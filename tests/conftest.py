"""Test set-up: 4 virtual CPU devices before JAX starts; a private TFDS dir."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

# Before anything imports JAX or TFDS.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "4"
_TFDS_DIR = tempfile.mkdtemp(prefix="jaxtrain-tfds-")
atexit.register(shutil.rmtree, _TFDS_DIR, ignore_errors=True)  # ~100 MB per test process


def _jit_cache_dir() -> str:
    """The test runs' compilation cache, kept between runs (as CI keeps the GPU leg's venv): one directory per
    Python, JAX and CPU, since XLA:CPU code is built for this processor's instruction set (AVX-512 or AVX2 only).
    A warm cache makes a run ~3x faster here; JAX keys each entry on the program, its flags and versions."""
    import hashlib
    import platform
    from importlib import metadata

    cpu = platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu += "".join(next((line for line in lines if line.startswith(k)), "") for k in ("model name", "flags"))
    key = f"{sys.version}|{metadata.version('jax')}|{metadata.version('jaxlib')}|{cpu}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxtrain" / "test-jit"
    path = cache / hashlib.sha256(key.encode()).hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


if "JAXTRAIN_TEST_JIT_CACHE" not in os.environ:  # shared with pytest-xdist workers when they inherit it
    os.environ["JAXTRAIN_TEST_JIT_CACHE"] = _jit_cache_dir()
os.environ["TFDS_DATA_DIR"] = _TFDS_DIR  # subprocesses inherit it too
os.environ["JAXTRAIN_INDEX_CACHE"] = os.path.join(_TFDS_DIR, "folder-indexes")  # image folders' indexes, likewise

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxtrain as jt  # noqa: E402

jt.setup_devices(4)  # as users do: also sets jaxtrain's XLA:CPU flags
# The test run's compiles are cached on disk (_jit_cache_dir), shared by both xdist workers and kept for the next
# run: the same programs recur across tests (one LeNet step built by many tests). Set in-process (jax.config, not
# the environment), so subprocesses get the cache only where run_cli adds it (never the killed runs of test_faults).
# A half-written entry read by the other worker is a warning and a recompile (jax_raise_persistent_cache_errors is off).
import jax  # noqa: E402

JIT_CACHE_BYTES = 2 << 30

jax.config.update("jax_compilation_cache_dir", os.environ["JAXTRAIN_TEST_JIT_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_compilation_cache_max_size", JIT_CACHE_BYTES)  # least recently used entries go first
if find_spec("jax_cuda12_plugin"):  # the gpu_compile leg: compile-only GPU programs cannot be read back (no GPU client)
    jax.config.update("jax_enable_compilation_cache", False)


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return f.read().count(b"\n")


_MAX_MAPPINGS = int(Path("/proc/sys/vm/max_map_count").read_text()) if os.path.exists("/proc/self/maps") else 0


@pytest.fixture(autouse=True)
def _compiled_programs_freed_before_the_kernel_limit():
    """A test process keeps every program it compiled (JAX's jit caches; the test modules' functools caches hold
    trainers), and XLA:CPU maps each one's machine code (~6 memory mappings for the smallest program; the process
    running tests/test_gpt.py alone passed 35,000). Past the kernel's vm.max_map_count (65530 by default) LLVM cannot
    allocate (``LLVM compilation error: Cannot allocate memory``) and jaxlib 0.10 crashes with a segmentation fault
    instead of raising: a full suite's worker reached it. So past half the limit the caches are cleared (a later
    call compiles again, from the disk cache)."""
    yield
    if _MAX_MAPPINGS and _mappings() > _MAX_MAPPINGS // 2:
        import gc

        jax.clear_caches()
        gc.collect()


ROOT = Path(__file__).resolve().parents[1]
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST_DIR.is_dir() and not os.environ.get("CI"),
    reason="Fashion-MNIST not installed (make data)",
)


def pytest_report_header(config):
    from importlib import metadata

    names = ("jax", "jaxlib", "flax", "optax", "chex", "orbax-checkpoint", "grain", "tensorflow-datasets", "numpy")
    versions = ", ".join(f"{n} {metadata.version(n)}" for n in names)
    return [f"Python {sys.version.split()[0]}: {versions}", f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}"]


@pytest.fixture(scope="session")
def tfds_dir() -> str:
    return _TFDS_DIR


@pytest.fixture
def use_settings(monkeypatch):
    """``use(**changes)``: jaxtrain.settings changed for this test (the process reads its environment once)."""
    import dataclasses

    from jaxtrain import settings

    def use(**changes):
        monkeypatch.setattr(settings, "_current", dataclasses.replace(settings.current(), **changes))

    return use


def random_batch(size: int, seed: int = 0) -> dict:
    """A tiny generated batch shaped like Fashion-MNIST (unit tests only)."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.random((size, 28, 28, 1), dtype=np.float32),
        "label": rng.integers(0, 10, size).astype(np.int32),
    }


@pytest.fixture
def command_line():
    """The library's log lines as a command line shows them while the test runs (``cli.library_log``: progress on
    stdout, ``warning: ...`` on stderr, parameters as flags)."""
    from jaxtrain import cli

    with cli.library_log():
        yield


def cached_compiles(env) -> dict:
    """``env`` plus JAX's persistent compilation cache (_jit_cache_dir), shared with the run's subprocesses (~3 s less
    per LeNet start here). Not for tests of start-up timing or of kills (test_faults.start leaves it out)."""
    return {**env, "JAX_COMPILATION_CACHE_DIR": os.environ["JAXTRAIN_TEST_JIT_CACHE"],
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_COMPILATION_CACHE_MAX_SIZE": str(JIT_CACHE_BYTES)}


def run_cli(*args: str, timeout: float = 600, env: dict | None = None):
    """Run ``python ARGS`` from the repo root like a user would (``env``: more variables; None unsets one); return
    the CompletedProcess."""
    import subprocess

    full_env = {**cached_compiles(os.environ), **(env or {})}
    full_env.pop("JAX_NUM_CPU_DEVICES", None)  # the CLI sets up its own devices
    full_env = {k: v for k, v in full_env.items() if v is not None}  # env={NAME: None}: NAME unset
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def reported_digests(stdout: str) -> set[str]:
    """The final ``params_digest`` every process of a run printed."""
    return {line.split("params_digest ")[1].strip() for line in stdout.splitlines() if "params_digest " in line}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(config, items):
    """The slow (subprocess, end-to-end) tests first: under ``-n 2`` they start at once and the short ones fill
    the gaps, instead of one long test running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise


@pytest.fixture(scope="session")
def torch_python() -> str:
    """A Python with torch, torchvision, timm, transformers and safetensors: $JAXTRAIN_TORCH_PYTHON, or
    tools/torch-venv's (built when missing). Without one the tests skip, except under CI (where the leg must run
    them: fail)."""
    python = os.environ.get("JAXTRAIN_TORCH_PYTHON")
    if not python:
        venv = Path(__file__).resolve().parents[1] / "tools" / "torch-venv"
        built = subprocess.run(["bash", str(venv)], capture_output=True, text=True)
        python = (built.stdout.strip().splitlines() or [None])[-1] if built.returncode == 0 else None
        if python is None:
            unavailable(f"no Python with torch: {built.stderr.strip()[-300:]}")
    return python


def unavailable(why: str) -> None:
    """What a test needs is not here: a skip with ``why``, except under CI (``make test`` installs it: the leg
    must run the test) a failure."""
    pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
