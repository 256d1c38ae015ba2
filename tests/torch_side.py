"""tests/torch_reference.py run in a Python with torch (conftest's ``torch_python``), and how close two outputs are."""

import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def reference(torch_python, *args) -> None:
    done = subprocess.run([torch_python, str(ROOT / "tests" / "torch_reference.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def relative(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def made_fixture(size: int):
    """A module-scoped fixture ``made(arch, classes)``: the directory of a random ``arch`` model's files for
    ``size`` x ``size`` images (tests/torch_reference.py's ``make``), built once per module."""

    @pytest.fixture(scope="module")
    def made(torch_python, tmp_path_factory):
        cache = {}

        def make(arch: str, classes: int):
            if (arch, classes) not in cache:
                out = tmp_path_factory.mktemp(arch)
                reference(torch_python, "make", arch, classes, size, out)
                cache[arch, classes] = out
            return cache[arch, classes]

        return make

    return made
