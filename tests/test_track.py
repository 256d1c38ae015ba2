"""--track wandb / mlflow: what a run logs, read back with each library's own reader (no mocks)."""

import json
import logging
import os
import subprocess
import sys

import pytest
from conftest import ROOT, needs_fashion_mnist, run_cli
from test_observe import read_events

from jaxtrain.driver import track

OFFLINE = {"WANDB_API_KEY": None, "NETRC": "/nonexistent", "WANDB_MODE": None, "MLFLOW_TRACKING_URI": None}


def read_mlflow(uri: str, experiment: str) -> dict:
    """The experiment's one run, read with MlflowClient: params, {metric: [(step, value)]}, status, artifacts."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    return {"params": run.data.params, "metrics": history, "status": run.info.status, "name": run.info.run_name,
            "artifacts": {a.path for a in client.list_artifacts(run.info.run_id)}}


def read_wandb(wandb_dir) -> dict:
    """The offline run's records, read with ``wandb leet inspect --json`` (W&B's own reader of its .wandb log)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_dir)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    run = next(r["run"] for r in records if r["type"] == "run")
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    metrics = {}
    for item in history:
        for key, value in item.items():
            prefix = key.split("/")[0]
            if "/" in key and not key.endswith("/step") and f"{prefix}/step" in item:
                metrics.setdefault(key, []).append((item[f"{prefix}/step"], value))
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    exit_code = next((r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"), None)
    return {"config": run["config"]["update"], "group": run.get("run_group"), "name": run.get("display_name"),
            "metrics": metrics, "summary": summary, "exit_code": exit_code}


@needs_fashion_mnist
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlflow", "wandb"])
def test_a_tracked_run_logs_what_tensorboard_gets_and_its_summary(tmp_path, kind):
    out = run_cli("-m", "experiments.lenet", "--devices", "1", "--train-subset", "1024", "--epochs", "2",
                  "--test-subset", "256", "--log-every", "2", "--out", str(tmp_path), "--no-progress",
                  "--track", kind, "--track-group", "grp", env=OFFLINE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning" not in out.stderr, out.stderr[-3000:]
    tensorboard = read_events(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    if kind == "mlflow":
        got = read_mlflow(f"sqlite:///{tmp_path}/mlflow.db", "grp")
        assert got["status"] == "FINISHED" and got["name"] == tmp_path.name
        assert got["params"]["lr"] == "0.2" and got["params"]["batch_size"] == "256"
        assert {"curves.png", "config.json"} <= got["artifacts"]
        assert list((tmp_path / "mlartifacts").rglob("curves.png")) and not (ROOT / "mlruns").exists()
        assert got["metrics"]["summary/test_acc"] == [(0, pytest.approx(summary["test_acc"]))]
    else:
        assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1  # offline: not logged in
        got = read_wandb(tmp_path / "wandb")
        assert got["group"] == "grp" and got["name"] == tmp_path.name and got["exit_code"] == 0
        assert got["config"]["lr"] == 0.2 and got["config"]["batch_size"] == 256
        assert got["summary"]["test_acc"] == pytest.approx(summary["test_acc"])
        assert got["summary"]["files/curves._type"] == "image-file"
        run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
        assert (run_dir / "files" / got["summary"]["files/curves.path"]).read_bytes()[:4] == b"\x89PNG"
    # every scalar TensorBoard got, at the same step
    for tag in ("train_step/loss", "train_step/examples_per_sec", "epoch/test_acc", "epoch/train_loss"):
        assert [s for s, _ in got["metrics"][tag]] == [s for s, _ in tensorboard[tag]], tag
        assert [v for _, v in got["metrics"][tag]] == pytest.approx([v for _, v in tensorboard[tag]], rel=1e-6), tag
    assert [s for s, _ in got["metrics"]["epoch/test_acc"]] == [1, 2]


def test_a_resumed_run_goes_on_in_the_same_tracked_run(tmp_path, monkeypatch, caplog):
    """Killed after epoch 2 was logged but before its checkpoint: the resumed run logs epoch 2 again (the same
    numbers, recomputed bit for bit), which MLflow must not hold twice."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = track.start("mlflow", tmp_path, {"lr": 0.1}, "g")
    first.scalars(1, {"test_acc": 0.5}, "epoch")
    first.scalars(2, {"test_acc": 0.75}, "epoch")
    first.close("killed")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert read_mlflow(uri, "g")["status"] == "KILLED"
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        again = track.start("mlflow", tmp_path, {"lr": 0.1}, "g", resumed=True)
    assert not caplog.records  # its tracked run was kept: nothing to say
    again.scalars(2, {"test_acc": 0.75, "train_loss": 0.3}, "epoch")
    again.finish({"test_acc": 0.75, "note": "text is left out"}, [tmp_path / "absent.png"])
    got = read_mlflow(uri, "g")
    assert got["status"] == "FINISHED" and got["metrics"]["epoch/test_acc"] == [(1, 0.5), (2, 0.75)]
    assert got["metrics"]["epoch/train_loss"] == [(2, 0.3)]  # a metric new at that step is logged
    assert got["metrics"]["summary/test_acc"] == [(0, 0.75)] and "summary/note" not in got["metrics"]


@pytest.mark.parametrize("kept, why", [(None, "is missing"), ("{not json", "cannot be read (JSONDecodeError"),
                                       ('{"failed": "--track mlflow: disk I/O error"}', "holds no mlflow run")])
def test_a_resumed_run_whose_tracked_run_was_not_kept_says_it_opens_a_new_one(tmp_path, monkeypatch, caplog, kept,
                                                                              why):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if kept is not None:
        (tmp_path / "track.json").write_text(kept)
    (tmp_path / "new").mkdir()
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        tracker = track.start("mlflow", tmp_path, {"lr": 0.1}, "g", resumed=True)
        track.start("mlflow", tmp_path / "new", {"lr": 0.1}, "g").close()  # a new run: nothing to say
    tracker.close("killed")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"--track mlflow: {tmp_path / 'track.json'} {why}"), lines
    assert lines[0].endswith(": this resumed run is logged to a new mlflow run (its earlier steps are in "
                             "metrics.jsonl)"), lines
    assert read_mlflow(f"sqlite:///{tmp_path}/mlflow.db", "g")["status"] == "KILLED"


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys, caplog):
    """One log line (logger jaxtrain.driver.track), as a command line says it (``cli.library_log``: ``warning:
    ...``)."""
    from jaxtrain import cli

    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it raises ImportError, as where it is not installed
    with cli.library_log():
        missing = track.start("wandb", tmp_path, {}, None)
        missing.scalars(1, {"loss": 1.0}, "train_step")
        missing.finish({"test_acc": 0.5}, [])
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "pip install 'jaxtrain[wandb]'" in err, err
    assert err.startswith("warning: --track wandb: off (wandb is not installed"), err

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/file/mlflow.db")  # cannot be made: a file there
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        broken = track.start("mlflow", tmp_path, {}, None)
        for step in range(3):
            broken.scalars(step, {"loss": 1.0}, "train_step")
        broken.close("failed")
    said = [r for r in caplog.records if r.name == "jaxtrain.driver.track"]
    assert broken.broken and len(said) == 1 and said[0].levelname == "WARNING", said
    assert said[0].getMessage().startswith("--track mlflow: off (FileExistsError"), said
    kept = json.loads((tmp_path / "track.json").read_text())  # for a sweep to say (it read only the exit code)
    assert kept["failed"].startswith("--track mlflow: FileExistsError"), kept


OPEN_ONE_STORE = """
import os, sys
from pathlib import Path
from jaxtrain.driver import track
tracker = track.start("mlflow", Path(sys.argv[1]), {"lr": 0.1}, "shared")
tracker.scalars(1, {"test_acc": 0.5}, "epoch")
tracker.finish({"test_acc": 0.5}, [])
"""


def test_runs_opening_one_new_mlflow_store_at_once_both_log(tmp_path):
    """(BAD 11) Two trials of a --parallel 2 sweep made the shared mlflow.db at once: one failed ("table ... already
    exists", "duplicate column name") and was never logged. Now they take turns (dirlock.taking_turns)."""
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    for i in range(2):
        (tmp_path / f"run{i}").mkdir()
    runs = [subprocess.Popen([sys.executable, "-c", OPEN_ONE_STORE, str(tmp_path / f"run{i}")], cwd=ROOT, env=env,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]
    errs = [r.communicate(timeout=600)[1] for r in runs]  # a safety net: each takes seconds
    assert not any("warning" in e for e in errs), errs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("shared").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]


def test_an_mlflow_server_that_does_not_answer_is_waited_for_boundedly_and_said(tmp_path, monkeypatch, capsys):
    """(MINOR) MLFLOW_TRACKING_URI=http://127.0.0.1:9 (nothing listens): the run stalled silently about 4 minutes
    (MLflow's 7 retries, backing off) before its one warning."""
    for name in track.HTTP_WAIT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    from jaxtrain import cli

    with cli.library_log():  # the warning is a log line; a command line says it so
        tracker = track.start("mlflow", tmp_path, {}, None)
    out, err = capsys.readouterr()  # what it waits for (a progress line), then the warning
    assert out == "--track mlflow: connecting to http://127.0.0.1:9 (up to 36 s if it does not answer)\n", out
    assert tracker.broken and err.startswith("warning: --track mlflow: off ("), err
    assert {k: os.environ[k] for k in track.HTTP_WAIT} == track.HTTP_WAIT


@pytest.mark.parametrize("env, mode", [({}, "offline"), ({"WANDB_API_KEY": "x" * 40}, "online"),
                                       ({"WANDB_MODE": "disabled"}, "disabled")])
def test_wandb_runs_offline_unless_the_user_logged_in(tmp_path, monkeypatch, env, mode):
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert track.wandb_mode() == mode
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert track.wandb_mode() == (mode if env else "online")  # `wandb login` wrote ~/.netrc
