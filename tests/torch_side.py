"""tests/torch_reference.py run in a Python with torch (conftest's ``torch_python``), and how close two outputs are."""

import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def reference(torch_python, *args) -> None:
    done = subprocess.run([torch_python, str(ROOT / "tests" / "torch_reference.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def relative(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
