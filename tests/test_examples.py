"""The docs' "Your own model and data" as a user runs it: the NNX example, CIFAR-10 through the ResNet-18 CLI."""

import json
import re
from pathlib import Path

import pytest
from conftest import needs_fashion_mnist, run_cli
from test_datasets import make_cifar_dir

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "nnx_mlp.py"


def test_the_readme_is_short_and_its_python_example_runs(tmp_path):
    """A newcomer's page: under 300 lines (it was 1,627), and its one Python example runs as printed."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    code = re.search(r"```python\n(.*?)```", readme, re.S)[1]
    script = tmp_path / "example.py"
    script.write_text(code + "\nprint('loss', float(metrics['loss']), trainer.plan(state).strategy.name)\n")
    out = run_cli(str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^loss 2\.30\d* shard_map$", out.stdout, re.M), out.stdout  # ln(10): the d2l init's first loss


def test_the_docs_show_the_example_as_it_is():
    code = EXAMPLE.read_text().split('"""', 2)[2].strip()
    assert code in (ROOT / "docs" / "own-model.md").read_text()
    assert len(code.splitlines()) <= 30  # "an NNX model trained through make_train_step in under 30 lines"


@pytest.mark.slow  # a subprocess that trains 2 epochs on 12,000 examples
@needs_fashion_mnist
def test_the_nnx_example_trains():
    out = run_cli(str(EXAMPLE))
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(re.search(r"^test accuracy ([\d.]+)$", out.stdout, re.M)[1])
    assert accuracy >= 0.75, out.stdout  # measured 0.821


@pytest.mark.slow  # a subprocess end to end
def test_resnet18_trains_on_cifar10_files_with_augmentation_and_onecycle(tmp_path):
    make_cifar_dir(tmp_path / "cifar", per_file=26, n_test=20)  # 130 train, 20 test images
    out = run_cli("-m", "experiments.resnet18", "--devices", "2", "--dataset", "cifar10", "--data-dir",
                  str(tmp_path / "cifar"), "--tfds-dir", str(tmp_path / "tfds"), "--optimizer", "momentum",
                  "--schedule", "onecycle", "--weight-decay", "5e-4", "--augment", "crop+flip", "--batch-size", "32",
                  "--epochs", "2", "--log-every", "1", "--out", str(tmp_path / "out"), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "130 train / 20 test examples of cifar10 (32x32x3, 10 classes)" in out.stdout, out.stdout
    assert "momentum lr 0.1 (onecycle)" in out.stdout, out.stdout
    lrs = [float(x) for x in re.findall(r"^step \d+: loss [\d.]+, lr ([\d.e-]+),", out.stdout, re.M)]
    assert len(lrs) >= 6 and max(lrs) > lrs[0] and lrs[-1] < max(lrs), lrs  # one cycle: up, then down
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["test_examples"] == 20
