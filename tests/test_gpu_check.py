"""experiments.gpu_check off a GPU: its one-line refusal, its parts cached between commands, its report. The
whole check on the CPU backend, from the bundle in a venv of the GPU image's versions, is tools/gpu-rehearse (CI)."""

import json

import pytest
from conftest import run_cli

from experiments import gpu_check_report as report
from jaxtrain.errors import ConfigError
from jaxtrain.gpu.targets import for_device


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    out = run_cli("-m", "experiments.gpu_check", "--out", str(tmp_path / "g"), env={"JAX_PLATFORMS": "cpu"})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "no GPU here" in out.stderr and "--dry-run" in out.stderr
    assert not (tmp_path / "g").exists()  # nothing half-written


def test_a_part_is_cached_until_asked_again_and_the_report_is_rewritten(tmp_path):
    def run(*more):
        return run_cli("-m", "experiments.gpu_check", "--dry-run", "--part", "env", "--out", str(tmp_path), *more)

    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"report: {tmp_path / 'report.md'}" in first.stdout
    cached = tmp_path / "parts" / "env.json"
    env = json.loads(cached.read_text())
    assert env["dry_run"] is True and env["backend"] == "cpu" and env["packages"]["jax"]
    # XLA's command-buffer flags as this jaxlib prints them (a GPU's plugin adds its own): names, types, defaults
    assert env["xla_command_buffer_flags"] and all(
        line.startswith("--xla_") and "command_buffer" in line for line in env["xla_command_buffer_flags"])
    assert "**DRY RUN**" in (tmp_path / "report.md").read_text()
    # A mark in the cached part (no clock): kept, and the report rewritten from it, until --again measures anew.
    cached.write_text(json.dumps({**env, "planted": True}))
    again = run()
    assert again.returncode == 0 and "env: cached in" in again.stderr
    assert json.loads((tmp_path / "report.json").read_text())["env"]["planted"] is True
    anew = run("--again")
    assert anew.returncode == 0 and "cached" not in anew.stderr
    assert "planted" not in json.loads(cached.read_text())
    assert "planted" not in json.loads((tmp_path / "report.json").read_text())["env"]


def test_a_kept_report_is_named_by_its_day_and_gpu_and_a_rehearsal_is_never_kept(tmp_path):
    env = {"date": "2026-11-27", "devices": ["NVIDIA H100 80GB HBM3"]}
    assert report.run_header({"env": env})["gpu"] == "h100" and report.run_header({"env": env})["date"] == env["date"]
    with pytest.raises(ConfigError, match="--part env"):
        report.run_header({"env": {**env, "devices": ["cpu"]}})
    out = run_cli("-m", "experiments.gpu_check", "--dry-run", "--keep", str(tmp_path / "kept"), "--out",
                  str(tmp_path / "g"))
    assert out.returncode == 2 and "no GPU's" in out.stderr and not (tmp_path / "kept").exists(), out.stderr


def test_the_device_kind_names_its_target():
    assert for_device("NVIDIA H100 80GB HBM3").key == "h100" and for_device("NVIDIA H200").key == "h200"
    assert for_device("cpu") is None and for_device("") is None


def test_junit_counts_and_a_failed_row_reach_the_report(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase name="a"><properties><property name="ratio" value="1.02"/>'
                   '</properties></testcase><testcase name="b"><failure message="boom"/>'
                   '</testcase><testcase name="c"><skipped/></testcase></testsuite></testsuites>')
    counts = report.junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1) and counts["failures"] == ["b: boom"]
    assert counts["figures"] == {"a: ratio": "1.02"}  # a bench figure a test recorded, reported (test_gpu.py)
    assert report.junit_counts(tmp_path / "none.xml")["passed"] == 0
    row = {"model": "resnet50", "precision": "bf16", "remat": "none", "batch": 256, "ms": 40.0,
           "examples_per_second": 6400.0, "estimate_ms": 42.0, "time_ratio": 40 / 42, "mfu": 0.157, "hfu": 0.152,
           "peak_bytes": 2**30, "memory_analysis": {"total": 2**30}, "memory_ratio": 1.0, "compile_s": 14.0}
    text = report.markdown({"tests": {"command": "pytest", "returncode": 1, "seconds": 3.0, **counts},
                            "steps": {"rows": [row, {"model": "vit", "precision": "bf16", "error": "OOM | x"}]}})
    assert "1 passed, 1 failed" in text and "- b: boom" in text and "- figure, a: ratio: 1.02" in text
    assert "| resnet50 | bf16 | none | 256 | 40.00 | 6,400 | 42.00 | 0.95 | 15.7% | 15.2% | 1,024 MiB |" in text
    assert "FAILED: OOM / x" in text  # a failed row is a finding in the report, its table intact


@pytest.mark.parametrize("flag", ["--help"])
def test_help_explains_the_parts(flag):
    out = run_cli("-m", "experiments.gpu_check", flag)
    assert out.returncode == 0 and all(p in out.stdout for p in ("env", "tests", "steps", "remat", "kernels"))
    assert "make gpu-bundle" in out.stdout and "--predict" in out.stdout


def test_the_command_buffer_modes_are_laid_side_by_side_with_a_failed_one_named():
    def steps(*ms, work=0.1):
        return {"work_ms_per_step": work, "rows": [{"k": k, "steps_per_call": n, "ms_per_step": m}
                                                   for (k, n), m in zip((("1", 1), ("8", 8), ("auto", 64)), ms)]}

    text = report.markdown({"buffers": {"lenet": {
        "xla": {**steps(0.4, 0.2, 0.12), "command_buffers": "XLA's own"},
        "off": {**steps(0.6, 0.3, 0.15), "command_buffers": "off"},
        "loops": {"error": "XlaRuntimeError: hung"}}}})
    assert "## Command buffers (CUDA graphs)" in text and "### lenet" in text
    assert "| K | xla ms/step | off ms/step | off/xla |\n|---|---|---|---|\n" in text
    assert "| 1 | 0.400 | 0.600 | 1.500 |" in text and "| auto (64) | 0.120 | 0.150 | 1.250 |" in text
    assert "- loops: FAILED: XlaRuntimeError: hung" in text
    assert "What each run's XLA_FLAGS left the command buffers: xla: XLA's own; off: off." in text
    alone = report.buffers_table({"off": steps(0.6, 0.3, 0.15)})  # XLA's own failed: no ratio columns
    assert alone[:2] == ["| K | off ms/step |", "|---|---|"] and alone[2] == "| 1 | 0.600 |"


def test_a_command_buffer_mode_that_did_not_reach_xla_fails_its_column(tmp_path, monkeypatch):
    """On a GPU each run records what its XLA_FLAGS left the command buffers: an XLA_FLAGS of the user's that names
    the flag (setup_devices then adds none), JAXTRAIN_XLA_DEFAULTS or an untested jaxlib leave every mode XLA's
    own, and three equal columns must not pass for a measurement."""
    import argparse
    import subprocess

    from experiments import gpu_check

    def run(cmd, env, **kw):  # each child as if its flag never reached XLA
        path = cmd[cmd.index("--json") + 1]
        with open(path, "w") as f:
            json.dump({"rows": [], "work_ms_per_step": 0.1, "command_buffers": "XLA's own"}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    got = gpu_check.part_buffers(argparse.Namespace(dry_run=False), lambda text: None)
    assert set(got) == {"lenet", "resnet18"}
    for modes in got.values():
        assert "error" not in modes["xla"]
        assert modes["off"]["error"] == "JAXTRAIN_COMMAND_BUFFERS=off did not reach XLA: its run had \"XLA's own\", " \
                                        "not 'off'"
        assert "JAXTRAIN_COMMAND_BUFFERS=loops did not reach XLA" in modes["loops"]["error"]
