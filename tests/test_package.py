"""The wheel as pip builds it: every file the package needs, its version and its license (issue 68)."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import needs_fashion_mnist, run_cli

import jaxtrain

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built from a copy of the checkout's tracked files (a build writes build/ and *.egg-info beside its
    sources: never into the checkout the other tests read)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(src)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("jaxtrain-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_every_file_of_the_package(wheel):
    """Each tracked file under jaxtrain/, Python or not: a source a kernel compiles on first use (onednn_conv.cc,
    jpeg_region.cc), the GPU targets (targets.json); the 0.1.0 wheel lacked jpeg_region.cc."""
    tracked = subprocess.run(["git", "ls-files", "jaxtrain"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    names = set(wheel.namelist())
    missing = [name for name in tracked if name not in names]
    assert not missing, f"files of the package missing from the wheel: {missing}"
    assert "jaxtrain/data/jpeg_region.cc" in names  # the file the 0.1.0 wheel lacked, named


def test_the_wheel_says_its_version_and_license(wheel):
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    assert re.search(rf"^Version: {re.escape(jaxtrain.__version__)}$", text, re.M)
    assert re.search(r"^License-Expression: MIT$", text, re.M)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist())
    assert re.fullmatch(r"\d+\.\d+\.\d+", jaxtrain.__version__)


def test_the_core_requires_no_extra_and_every_extra_is_declared(wheel):
    """Issue 68: `pip install jaxtrain` is the core; each optional feature's packages come with its extra."""
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    lines = wheel.read(metadata).decode().splitlines()
    core = {re.split(r"[<>=!~; \[]", line.split(": ", 1)[1])[0].lower().replace("_", "-") for line in lines
            if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert core == {"jax", "flax", "optax", "chex", "numpy", "tensorflow-datasets", "importlib-resources", "grain",
                    "orbax-checkpoint", "tqdm"}, core
    extras = {line.split(": ", 1)[1] for line in lines if line.startswith("Provides-Extra:")}
    assert {"images", "plots", "tensorboard", "quantize", "sweep", "pretrained", "cpu-conv", "track", "notebook",
            "all"} <= extras


def test_the_changelog_names_this_version():
    assert f"## {jaxtrain.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_the_wheel_installs_the_jaxtrain_command(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "[console_scripts]\njaxtrain = jaxtrain.__main__:main" in wheel.read(entry_points).decode()


def test_the_command_says_its_version_and_its_commands():
    version = run_cli("-m", "jaxtrain", "--version")
    assert version.returncode == 0 and version.stdout == f"jaxtrain {jaxtrain.__version__}\n", version.stderr
    helped = run_cli("-m", "jaxtrain", "--help")
    assert helped.returncode == 0 and all(f"  {c}" in helped.stdout for c in ("lenet", "resnet18", "vit", "train",
                                                                              "sweep", "slurm", "gpu-plan"))
    bare = run_cli("-m", "jaxtrain")
    assert bare.returncode == 2 and bare.stderr.startswith("usage: jaxtrain COMMAND")
    unknown = run_cli("-m", "jaxtrain", "lenett")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and "unknown command 'lenett'" in unknown.stderr
    flags = run_cli("-m", "jaxtrain", "lenet", "--devices", "0")  # the run's own parser, named as the command
    assert flags.returncode == 2 and "jaxtrain lenet: error:" in flags.stderr, flags.stderr
    for tool in ("sample", "export", "sweep", "slurm", "gpu-plan"):  # each says its usage as the command the user typed
        helped = run_cli("-m", "jaxtrain", tool, "--help")
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: jaxtrain {tool} "), helped.stdout[:300]


@needs_fashion_mnist
def test_jaxtrain_lenet_trains_as_the_experiment_does(tmp_path):
    run = run_cli("-m", "jaxtrain", "lenet", "--devices", "2", "--max-steps", "2", "--epochs", "1",
                  "--train-subset", "512", "--test-subset", "256", "--no-progress", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "summary.json").is_file()
