"""Diagnostics: memory report, batch-size finder, model summary, MFU inputs, transfer experiment."""

import json

import jax
import numpy as np
import optax
import pytest
from conftest import needs_fashion_mnist, run_cli

import jaxtrain as jt
from jaxtrain.analysis import diagnostics
from jaxtrain.analysis.batch_size import find_batch_size, parse_bytes
from jaxtrain.core import compat
from jaxtrain.models import lenet


def test_memory_report_on_cpu_says_what_is_not_reported():
    report = diagnostics.memory_report()
    assert report["host"]["total_bytes"] > report["host"]["used_bytes"] > 0
    assert len(report["devices"]) == len(jax.local_devices())
    for d in report["devices"]:
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            assert isinstance(d[key], int) or d[key] == diagnostics.NOT_REPORTED
    assert "cpu:0" in diagnostics.format_memory_report(report)


def make_batch(size):
    return {"image": np.zeros((size, 28, 28, 1), np.float32), "label": np.zeros(size, np.int32)}


@pytest.fixture(scope="module")
def finder_result():
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    return trainer, state, find_batch_size(trainer, state, make_batch, budget_bytes=24 * 2**20)


def test_batch_size_finder_fits_the_budget_and_the_next_does_not(finder_result):
    trainer, state, r = finder_result
    assert r.batch_size % 2 == 0 and r.next_batch_size == r.batch_size + 2
    assert r.predicted_bytes <= r.budget_bytes < r.next_bytes
    sizes = [b for b, _ in r.table]
    needs = [m for _, m in r.table]
    assert all(b > a for a, b in zip(needs, needs[1:])), "predicted footprint grows with the batch"
    assert len(sizes) >= 5 and r.r2 > 0.99 and r.bytes_per_example > 0
    # The prediction is the compiled step's own analysis, not an extrapolation.
    direct = diagnostics.step_bytes(jt.compiled_stats(trainer, state, make_batch(r.batch_size), residuals=False))
    assert direct == r.predicted_bytes


def test_batch_size_finder_errors(finder_result):
    trainer, state, _ = finder_result
    with pytest.raises(jt.ConfigError, match="smaller than the model itself"):
        find_batch_size(trainer, state, make_batch, budget_bytes=100 * 2**10)
    with pytest.raises(jt.ConfigError, match="pass budget_bytes="):
        find_batch_size(trainer, state, make_batch)  # CPU reports no limit
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MB") == 512 * 2**20 and parse_bytes("1e6") == 10**6
    with pytest.raises(jt.ConfigError, match="memory size"):
        parse_bytes("lots")


def test_summary_of_the_d2l_lenet():
    params = lenet.init_params(jax.random.key(0))
    s8 = diagnostics.summarize(params, lenet.apply, np.zeros((8, 28, 28, 1), np.float32))
    s64 = diagnostics.summarize(params, lenet.apply, np.zeros((64, 28, 28, 1), np.float32))
    assert s8["total_params"] == 20 * 9 + 20 + 50 * 20 * 25 + 50 + 800 * 128 + 128 + 128 * 10 + 10 == 129_068
    assert s8["layers"] == {"conv1": 200, "conv2": 25_050, "dense1": 102_528, "dense2": 1_290}
    assert s8["bytes_fp32"] == 4 * 129_068 and s8["bytes_bf16"] == 2 * 129_068
    assert s8["flops_per_example"] > 0
    assert abs(s64["flops_per_example"] / s8["flops_per_example"] - 1) < 0.01  # stable across batch sizes
    assert "129,068" in diagnostics.format_summary(s8)


def test_compiled_flops_are_per_device():
    batch = make_batch(256)
    one, two = (jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=n) for n in (1, 2))
    f1 = jt.compiled_stats(one, one.init(lenet.init_params(jax.random.key(0))), batch, residuals=False)["flops"]
    f2 = jt.compiled_stats(two, two.init(lenet.init_params(jax.random.key(0))), batch, residuals=False)["flops"]
    assert abs(2 * f2 / f1 - 1) < 0.02


def test_peaks():
    """The MFU's peaks: one table (targets.json), the most specific name first, the precision's tensor cores."""
    from jaxtrain import gpu

    assert gpu.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == gpu.target("h100").peak_flops("bf16") == 989.5e12
    assert gpu.peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12  # not the SXM's
    assert gpu.peak_flops("NVIDIA H100 PCIe", "fp32") == 378e12  # TF32: XLA's f32 matmuls there
    assert gpu.peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    # not the A100's or the L40S's
    assert gpu.peak_flops("NVIDIA A10", "bf16") == 125e12 and gpu.peak_flops("NVIDIA L4", "bf16") == 121e12
    assert gpu.peak_flops("Tesla T4", "fp32") == 8.1e12 and gpu.peak_flops("Tesla V100-SXM2-16GB", "fp16") == 125e12
    assert gpu.peak_flops("cpu", "fp32") is None and gpu.peak_flops("NVIDIA GH200 480GB", "bf16") is None
    assert diagnostics.measure_matmul_peak(n=256, repeats=2) > 1e8


def test_transfer_experiment_smoke(tmp_path):
    out = run_cli("-m", "experiments.transfer", "--sizes", "64", "--repeats", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| 64 |" in out.stdout and (tmp_path / "transfer.png").stat().st_size > 1000


@pytest.mark.slow  # a subprocess end to end
def test_batch_size_cli(tmp_path):
    out = run_cli("-m", "experiments.batch_size", "--devices", "1", "--memory-budget", "16MiB")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "R^2" in out.stdout and "-> batch" in out.stdout
    out = run_cli("-m", "experiments.batch_size", "--devices", "1")
    assert out.returncode == 2 and "--memory-budget" in out.stderr and "Traceback" not in out.stderr


@needs_fashion_mnist
def test_experiment_records_throughput(tmp_path):
    out = run_cli("-m", "experiments.lenet", "--devices", "2", "--max-steps", "5", "--out", str(tmp_path),
                  "--summary", "--memory-report", "--measure-peak", "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "129,068" in out.stdout and "memory after the first step" in out.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["ms_per_step"] > 0 and s["achieved_flops_per_sec"] > 0 and 0 < s["mfu"] < 1
    assert s["platform"] == "cpu" and s["cpu_isa"] == compat.cpu_isa()  # CPU results name their vector ISA


def test_a_step_larger_than_free_host_memory_is_warned_before_it_runs(monkeypatch):
    """A batch that exhausted host memory was killed (exit 137) with no message."""
    from jaxtrain.analysis import diagnostics

    stats = {"temp_bytes": 3 * 2**30, "output_bytes": 2**30, "alias_bytes": 2**30, "argument_bytes": 2**30}
    devices = jax.devices()[:2]
    monkeypatch.setattr(diagnostics, "_host_memory", lambda: (20 * 2**30, 24 * 2**30))  # 4 GiB free
    warning = diagnostics.host_memory_warning(stats, devices)
    assert warning.startswith("one step needs ~6.0 GiB more host memory (2 devices x 3.00 GiB) and 4.0 GiB")
    assert "smaller batch_size=" in warning
    monkeypatch.setattr(diagnostics, "_host_memory", lambda: (4 * 2**30, 24 * 2**30))  # 20 GiB free
    assert diagnostics.host_memory_warning(stats, devices) is None
