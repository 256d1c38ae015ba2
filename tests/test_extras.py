"""jaxtrain's core without its extras (issue 68): a run trains, and each feature whose extra is missing says in one
line what to install. The packages are hidden from a subprocess by an import hook (``sitecustomize``), as they
are absent from a venv with the core wheel alone (CI's wheel leg, tools/wheel-check, installs one)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import needs_fashion_mnist

from jaxtrain.errors import EXTRAS, MissingExtra, missing, need

ROOT = Path(__file__).resolve().parents[1]
EVERY_EXTRA = ",".join(EXTRAS)
HIDE = '''import importlib.abc, os, sys

HIDDEN = set(os.environ["HIDDEN"].split(","))


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Hide())
'''


@pytest.fixture
def without(tmp_path):
    """``without(hidden, *args)``: ``python *args`` in tmp_path with the modules ``hidden`` (comma-separated) not
    importable."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE)

    def run(hidden: str, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "HIDDEN": hidden, "PYTHONPATH": f"{tmp_path / 'hide'}:{ROOT}"}
        env.pop("JAX_NUM_CPU_DEVICES", None)
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)

    return run


def test_every_extra_named_in_the_messages_is_one_pyproject_declares():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, (package, extra) in EXTRAS.items():
        assert extra in extras and any(dep.lower().startswith(package.lower()) for dep in extras[extra]), module
    (everything,) = extras["all"]  # jaxtrain[images,plots,...]: every extra but the GPUs', the tests' and the docs'
    assert everything.startswith("jaxtrain[") and everything.endswith("]")
    named = set(everything[len("jaxtrain["):-1].split(","))
    assert {"images", "text", "plots", "tensorboard", "quantize", "sweep", "pretrained", "cpu-conv", "track",
            "notebook"} == named
    assert {extra for _, extra in EXTRAS.values()} <= named | set(extras["track"][0][len("jaxtrain["):-1].split(","))
    assert "jaxtrain[all]" in extras["test"]  # make test installs everything


def test_need_says_the_feature_the_package_and_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna: ImportError
    with pytest.raises(MissingExtra) as e:
        need("optuna", "jaxtrain sweep")
    assert str(e.value) == "jaxtrain sweep needs optuna, which is not installed: pip install 'jaxtrain[sweep]'"
    assert e.value.EXIT_CODE == 2
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert missing("matplotlib", "curves.png") == ("curves.png left out: matplotlib is not installed (pip install "
                                                   "'jaxtrain[plots]')")
    assert missing("json", "anything") is None


def test_a_package_there_but_broken_raises_its_own_error(monkeypatch, tmp_path):
    """Only the package's own absence is a missing extra: a module it needs, or one of its own, missing is a
    broken install, said as itself."""
    for name, body in (("optuna", "import no_such_dependency\n"), ("wandb", "import wandb._no_such_part\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("optuna", "wandb"):
        monkeypatch.delitem(sys.modules, module, raising=False)
        with pytest.raises(ImportError) as e:
            need(module, "the feature")
        assert not isinstance(e.value, MissingExtra) and e.value.name not in (None, module), e.value


@needs_fashion_mnist
def test_a_run_with_the_core_alone_trains_and_says_what_it_left_out(without, tmp_path):
    """No Pillow, matplotlib, tensorboard, qwix, optuna, safetensors, wandb, mlflow: LeNet trains on 2 devices; the
    curves and the TensorBoard events are each said once as left out; --track wandb warns and goes on."""
    run = without(EVERY_EXTRA, "-m", "jaxtrain", "lenet", "--devices", "2", "--max-steps", "4", "--train-subset",
                  "256", "--test-subset", "128", "--batch-size", "64", "--no-progress", "--track", "wandb",
                  "--out", "o")
    assert run.returncode == 0, run.stderr[-3000:]
    said = run.stdout + run.stderr
    assert "Traceback" not in said, said[-3000:]
    for line in ("note: TensorBoard events left out: tensorboard is not installed (pip install "
                 "'jaxtrain[tensorboard]')",
                 "warning: curves.png left out: matplotlib is not installed (pip install 'jaxtrain[plots]')"):
        assert said.count(line) == 1, said[-3000:]
    assert "pip install 'jaxtrain[wandb]'" in said, said[-3000:]
    assert "metrics.jsonl\n" in run.stdout and "curves.png" not in run.stdout.split("wrote ")[-1]
    files = {p.name for p in (tmp_path / "o").iterdir()}
    assert {"summary.json", "metrics.jsonl"} <= files and not any(
        f == "curves.png" or f.startswith("events.out.tfevents") for f in files), files


@pytest.mark.parametrize("extra, hidden, args, line", [  # each command's error: exit 2
    ("images", "PIL", ["-m", "jaxtrain", "lenet", "--dataset", "folder:."],
     "jaxtrain lenet: error: image folders (--dataset folder:PATH) needs Pillow, which is not installed: pip "
     "install 'jaxtrain[images]'"),
    ("quantize", "qwix", ["-m", "jaxtrain", "lenet", "--quantize", "int8", "--max-steps", "1"],
     "jaxtrain lenet: error: model lenet: int8 quantisation (--quantize int8) needs qwix, which is not installed: pip "
     "install 'jaxtrain[quantize]'"),
    ("sweep", "optuna", ["-m", "jaxtrain", "sweep", "--help"],
     "jaxtrain sweep: error: jaxtrain sweep needs optuna, which is not installed: pip install 'jaxtrain[sweep]'"),
    ("sweep", "optuna", ["-m", "jaxtrain.sweep", "--help"],
     "python -m jaxtrain.sweep: error: jaxtrain sweep needs optuna, which is not installed: pip install "
     "'jaxtrain[sweep]'"),
    ("pretrained", "safetensors", ["-c", "import numpy as np; from jaxtrain.cli import main; from jaxtrain.errors "
     "import ConfigError\nfrom jaxtrain.pretrained import tensors\ntry:\n  tensors.write({'w': np.zeros(2)}, "
     "'w.safetensors')\nexcept ConfigError as e:\n  raise SystemExit(f'error: {e}')"],
     "error: writing w.safetensors needs safetensors, which is not installed: pip install 'jaxtrain[pretrained]'"),
])
def test_a_feature_whose_extra_is_missing_says_what_to_install(without, extra, hidden, args, line):
    """Its error is the last line (a note may come before it: e.g. oneDNN's convolutions left out on a machine
    without them), and no traceback."""
    run = without(hidden, *args)
    assert run.returncode == (1 if args[0] == "-c" else 2), (run.returncode, run.stderr[-3000:])  # -c: SystemExit
    assert run.stderr.strip().splitlines()[-1] == line and "Traceback" not in run.stderr, run.stderr[-3000:]
