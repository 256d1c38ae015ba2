"""Watching a run: step lines, TensorBoard events read back, the profiler trace and its named scopes."""

import gzip
import json
import re

import pytest
from conftest import needs_fashion_mnist, run_cli


def read_events(run_dir):
    """{tag: [(step, value)]} of a run's TensorBoard events, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"]}


@needs_fashion_mnist
@pytest.mark.slow
def test_log_lines_tensorboard_events_and_a_profile_of_chosen_steps(tmp_path):
    out = run_cli("-m", "experiments.lenet", "--devices", "2", "--train-subset", "1024", "--epochs", "2",
                  "--test-subset", "256", "--log-every", "2", "--profile", "2:4", "--out", str(tmp_path),
                  "--eval-every", "2", "--eval-every-steps", "6", "--no-progress")  # 4 steps per epoch
    assert out.returncode == 0, out.stderr[-3000:]
    lines = re.findall(r"^step (\d+): loss [\d.]+, lr 0\.2, [\d,]+ examples/s, data wait \d+%$", out.stdout, re.M)
    assert lines == ["1", "3", "5", "7"], out.stdout  # every 2 steps, each the step before (read one step late)

    by_tag = read_events(tmp_path)
    assert [s for s, _ in by_tag["train_step/loss"]] == [1, 3, 5, 7]
    assert all(2.0 < v < 2.5 for _, v in by_tag["train_step/loss"])
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(s, round(v, 5)) for s, v in by_tag["epoch/test_acc"]] == [(2, round(metrics[1]["test_acc"], 5))]
    assert metrics[0]["test_examples"] == 0 and "epoch 1/2: train loss" in out.stdout and "not evaluated" in out.stdout
    tested = re.findall(r"^step (\d+): test loss [\d.]+, test acc ([\d.]+) \(256 examples", out.stdout, re.M)
    assert [s for s, _ in tested] == ["6"] and [s for s, _ in by_tag["test_step/accuracy"]] == [6], out.stdout
    assert b'"batch_size": 256' in by_tag["config"][0][1]

    traces = list((tmp_path / "profile").rglob("perfetto_trace.json.gz"))
    assert len(traces) == 1 and list((tmp_path / "profile").rglob("*.xplane.pb"))
    names = {e.get("name") for e in json.load(gzip.open(traces[0]))["traceEvents"]}
    assert {"data_wait", "train_step"} <= names, sorted(n for n in names if n)[:50]
    drawn = run_cli("tools/trace_png.py", f"lenet={tmp_path / 'profile'}", "--out", str(tmp_path / "trace.png"))
    assert drawn.returncode == 0 and (tmp_path / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", drawn.stderr


def test_a_bad_profile_range_is_a_one_line_error(tmp_path):
    out = run_cli("-m", "experiments.lenet", "--profile", "5:3", "--out", str(tmp_path))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "python -m experiments.lenet: error: --profile 5:3: expected 1 <= START < STOP"], out.stderr
