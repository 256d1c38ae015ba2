"""The code passes ruff's checks as pyproject.toml sets them (pycodestyle and pyflakes, lines of at most 120
characters), so that style is enforced by the tests rather than by each reader."""

import subprocess
import sys
from importlib.util import find_spec

import pytest
from conftest import ROOT


def test_the_code_passes_ruff():
    if find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'", pytrace=False)
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.fail(f"ruff check (exit {out.returncode}):\n{out.stdout}{out.stderr}", pytrace=False)
