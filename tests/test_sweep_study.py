"""jaxtrain.sweep over a fake trial command: the study's draws and budget, diverged trials, signals, bad folders and
databases. The fake trial (FAKE_TRIAL) takes ``--lr`` and ``--out`` and writes its result at once: no training."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, run_cli

pytest.importorskip("optuna")

import optuna

from jaxtrain.sweep import study as S
from jaxtrain.errors import ConfigError
from jaxtrain.sweep.command import sweep

FAKE_TRIAL = textwrap.dedent("""
    import json, os, pathlib, sys, time
    args = sys.argv[1:]
    out, lr = pathlib.Path(args[args.index("--out") + 1]), float(args[args.index("--lr") + 1])
    number = int(out.name.split("-")[1])
    events = os.environ.get("FAKE_EVENTS")  # a folder: say "started-N" there
    if events:
        pathlib.Path(events, f"started-{number}").write_text(str(os.getpid()))
    together = int(os.environ.get("FAKE_TOGETHER", "0"))  # the first trials wait until this many have started
    if number < together:
        deadline = time.time() + 600  # a safety net only: the other worker's trial starts within seconds
        while len(list(pathlib.Path(events).glob("started-*"))) < together and time.time() < deadline:
            time.sleep(0.05)
    if os.environ.get("FAKE_WAIT_FOR_SIGNAL"):  # stay until a signal, and say each one received
        import signal
        def got(signum, frame):
            with open(pathlib.Path(events, "signals"), "a") as f:
                f.write(signal.Signals(signum).name + "\\n")
            sys.exit(128 + signum)
        signal.signal(signal.SIGTERM, got)
        signal.signal(signal.SIGINT, got)
        pathlib.Path(events, "waiting").write_text("")
        while True:
            signal.pause()
    if lr > float(os.environ.get("FAKE_DIVERGE_ABOVE", "inf")):
        print(f"the loss became nan at step 3: training diverged (lr {lr})")
        sys.exit(3)
    if str(number) in os.environ.get("FAKE_FAIL", "").split(",") or os.environ.get("FAKE_FAIL") == "all":
        print("ModuleNotFoundError: No module named 'experiments'")
        sys.exit(1)
    if number < int(os.environ.get("FAKE_OOM_BELOW", "0")):  # each trial's own error: its own size's OOM
        print(f"RESOURCE_EXHAUSTED: Out of memory allocating {number * 1000 + 7} bytes")
        sys.exit(1)
    if os.environ.get("FAKE_FAIL_IN_OUT"):  # the same error, naming the trial's own folder
        print(f"PermissionError: [Errno 13] Permission denied: '{out}/model'")
        sys.exit(1)
    if os.environ.get("FAKE_TRACK_FAILS"):
        (out / "track.json").write_text(json.dumps({"failed": "--track mlflow: OperationalError: disk I/O error"}))
    (out / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_acc": lr}) + "\\n")
    (out / "summary.json").write_text(json.dumps({"test_acc": lr}))
""")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake trial's command; its events folder in FAKE_EVENTS."""
    script = tmp_path / "fake_trial.py"
    script.write_text(FAKE_TRIAL)
    (tmp_path / "events").mkdir()
    monkeypatch.setenv("FAKE_EVENTS", str(tmp_path / "events"))
    return [sys.executable, str(script)]


def quiet(*_, **__):
    pass


def lrs(db, study: str) -> dict[int, float]:
    """{trial number: lr} of the study's finished trials."""
    s = optuna.load_study(study_name=study, storage=f"sqlite:///{db}")
    return {t.number: t.params["lr"] for t in s.trials if t.state.is_finished() and "lr" in t.params}


def test_a_sweep_continued_in_chunks_draws_what_one_uninterrupted_sweep_draws(tmp_path, fake):
    """(BAD 6) Each invocation seeded its sampler with 0: --trials 1, 2, 3 gave all three trials the same lr."""
    for n in (1, 2, 3):
        sweep("chunks", f"sqlite:///{tmp_path}/c.db", ["lr=log:1e-3:1"], n, command=fake, say=quiet)
    sweep("whole", f"sqlite:///{tmp_path}/w.db", ["lr=log:1e-3:1"], 3, command=fake, say=quiet)
    chunked, whole = lrs(tmp_path / "c.db", "chunks"), lrs(tmp_path / "w.db", "whole")
    assert len(set(chunked.values())) == 3 and chunked == whole, (chunked, whole)


def test_two_workers_on_one_study_draw_as_one_sweep_and_stop_at_its_budget(tmp_path, fake):
    """(BAD 7) Two sweeps on one study (both seeded 0) drew the same settings; --trials 7 finished 8 trials. The
    first two trials wait for each other: both workers are surely at work at once."""
    db, n = tmp_path / "w.db", 5
    argv = [sys.executable, "-m", "jaxtrain.sweep", "--study", "two", "--storage", f"sqlite:///{db}",
            "--trials", str(n), "--param", "lr=log:1e-3:1", "--", *fake]
    sweep("warm", f"sqlite:///{db}", ["lr=log:1e-3:1"], 1, command=fake, say=quiet)  # the tables exist: the
    env = {**os.environ, "FAKE_TOGETHER": "2"}  # workers race for trials here, not for making the database
    workers = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for _ in range(2)]
    outs = [w.communicate(timeout=600)[0] for w in workers]  # a safety net: each ends in seconds
    assert [w.returncode for w in workers] == [0, 0], outs
    s = optuna.load_study(study_name="two", storage=f"sqlite:///{db}")
    finished = [t for t in s.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(finished) == n, [(t.number, t.state.name) for t in s.trials]
    assert {t.user_attrs["pid"] for t in finished} == {w.pid for w in workers}  # both took trials
    sweep("one", f"sqlite:///{tmp_path}/one.db", ["lr=log:1e-3:1"], n, command=fake, say=quiet)
    assert lrs(db, "two") == lrs(tmp_path / "one.db", "one")  # the same draws, trial for trial: all distinct
    assert len(set(lrs(db, "two").values())) == n


def test_a_worker_that_loses_the_race_for_the_last_trial_puts_its_trial_back(tmp_path):
    """The budget is exact: the trial made after the last place was taken waits (no settings) instead of running."""
    rdb = S.storage_of(f"sqlite:///{tmp_path}/s.db")
    s = S.open_study("race", rdb, "maximize", False, {"command": ["x"], "params": []}, None)
    first = S.claim(s, rdb, 2)
    ask = s.ask

    def racing_ask(*a, **k):  # another worker takes the last place between our count and our ask
        ask()
        return ask()

    s.ask = racing_ask
    assert S.claim(s, rdb, 2) is None
    assert [t.state.name for t in s.trials] == ["RUNNING", "RUNNING", "WAITING"]
    s.ask = ask
    s.tell(first, state=optuna.trial.TrialState.FAIL)  # a place frees: the waiting trial is taken first
    assert S.claim(s, rdb, 2).number == 2 and S.claim(s, rdb, 2) is None


def test_a_diverged_trial_is_pruned_and_the_sweep_goes_on(tmp_path, fake, monkeypatch):
    """(BAD 3) A run that diverged exited 2, which the sweep took for a usage error: it stopped after one trial.
    Now the run exits 3 (errors.Diverged.EXIT_CODE; tests/test_faults.py) and the trial is pruned."""
    monkeypatch.setenv("FAKE_DIVERGE_ABOVE", "0.1")
    said = []
    s = sweep("div", f"sqlite:///{tmp_path}/s.db", ["lr=log:1e-3:1"], 6, command=fake,
              say=lambda *a, **k: said.append(" ".join(map(str, a))))
    states = [t.state.name for t in s.trials]
    diverged = [t for t in s.trials if "diverged" in t.user_attrs]
    assert len(states) == 6 and "FAIL" not in states and diverged, states
    assert all(t.state.name == "PRUNED" and t.params["lr"] > 0.1 for t in diverged)
    assert any("diverged, pruned: the loss became nan at step 3: training diverged" in line for line in said), said
    assert any("| pruned (diverged) |" in line for text in said for line in text.splitlines()), said


def test_trials_failing_one_after_another_stop_the_sweep_and_one_that_succeeds_between_them_does_not(tmp_path, fake,
                                                                                                       monkeypatch):
    """A new user's finding: a trial command that could not start (run from another folder: "No module named
    'experiments'", exit 1) failed every trial, and the sweep drew 3,895 of them in 14 minutes."""
    monkeypatch.setenv("FAKE_FAIL", "all")
    with pytest.raises(ConfigError, match=r"the last 3 trials failed, one after another, with the same error \(trial "
                                          r"2: exit code 1: .*No module named 'experiments'.*\): mend the command "
                                          r"\(or give --max-failures more\), then run the same sweep again to go on"
                       ) as e:
        sweep("f", f"sqlite:///{tmp_path}/s.db", ["lr=log:1e-3:1"], 20, command=fake, say=quiet)
    assert _states(tmp_path / "s.db") == ["FAIL"] * 3 and "\n" not in str(e.value)
    monkeypatch.setenv("FAKE_FAIL", "0,1,3,4")  # a trial that ends between failures: the count starts again
    s = sweep("between", f"sqlite:///{tmp_path}/b.db", ["lr=log:1e-3:1"], 3, command=fake, say=quiet)
    assert "".join(t.state.name[0] for t in s.trials) == "FFCFFCC"
    monkeypatch.setenv("FAKE_FAIL", "0,1,2,3")
    s = sweep("never", f"sqlite:///{tmp_path}/n.db", ["lr=log:1e-3:1"], 1, command=fake, say=quiet, max_failures=0)
    assert "".join(t.state.name[0] for t in s.trials) == "FFFFC"  # 0: failures never stop it
    monkeypatch.setenv("FAKE_FAIL", "")
    monkeypatch.setenv("FAKE_OOM_BELOW", "4")  # failures that differ (each its own size's OOM) do not stop it
    s = sweep("oom", f"sqlite:///{tmp_path}/o.db", ["lr=log:1e-3:1"], 1, command=fake, say=quiet)
    assert "".join(t.state.name[0] for t in s.trials) == "FFFFC"
    monkeypatch.setenv("FAKE_OOM_BELOW", "0")
    monkeypatch.setenv("FAKE_FAIL_IN_OUT", "1")  # alike but for the trial's folder: alike
    with pytest.raises(ConfigError, match=r"the last 3 trials failed.* Permission denied: '.*/trial-0002/model'"):
        sweep("own", f"sqlite:///{tmp_path}/w.db", ["lr=log:1e-3:1"], 9, command=fake, say=quiet)
    for bad in (-1, True):
        with pytest.raises(ConfigError, match=f"max_failures={bad}: expected a whole number >= 0"):
            sweep("neg", f"sqlite:///{tmp_path}/o.db", ["lr=log:1e-3:1"], 1, command=fake, say=quiet,
                  max_failures=bad)


def test_a_usage_error_of_a_trial_stops_the_sweep(tmp_path):
    (tmp_path / "usage.py").write_text("import sys\nprint('error: unrecognized arguments: --lr')\nsys.exit(2)\n")
    out = run_cli("-m", "jaxtrain.sweep", "--study", "u", "--storage", f"sqlite:///{tmp_path}/s.db", "--trials", "3",
                  "--param", "lr=log:1e-3:1", "--", sys.executable, str(tmp_path / "usage.py"))
    assert out.returncode == 2 and "failed with a usage error: error: unrecognized arguments" in out.stderr
    assert _states(tmp_path / "s.db") == ["FAIL"]


def _states(db) -> list[str]:
    with sqlite3.connect(db) as con:
        return [s for (s,) in con.execute("SELECT state FROM trials ORDER BY number")]


def test_an_unwritable_dir_is_one_line_before_any_trial(tmp_path, fake):
    """(BAD 5) An unwritable --dir was an OSError traceback (and a FAIL trial where the folder existed)."""
    (tmp_path / "file").write_text("")
    out = run_cli("-m", "jaxtrain.sweep", "--study", "s", "--storage", f"sqlite:///{tmp_path}/s.db", "--dir",
                  str(tmp_path / "file" / "sub"), "--param", "lr=log:1e-3:1", "--", *fake)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"--dir: cannot write in {tmp_path}/file/sub (Not a directory)" in out.stderr
    assert not (tmp_path / "s.db").exists() or _states(tmp_path / "s.db") == []


def test_a_missing_command_and_a_misspelt_objective_are_one_line_before_any_trial(tmp_path):
    """(BAD 2, and a MINOR) A missing command was a FileNotFoundError traceback; a misspelt --objective was
    reported after the first trial had trained."""
    base = ["-m", "jaxtrain.sweep", "--study", "s", "--storage", f"sqlite:///{tmp_path}/s.db", "--param",
            "lr=log:1e-3:1"]
    missing = run_cli(*base, "--", "/nonexistent/cmd")
    misspelt = run_cli(*base, "--objective", "test_accc", "--", "python", "-m", "experiments.lenet")
    for out, says in ((missing, "command not found: /nonexistent/cmd"),
                      (misspelt, "--objective test_accc: not a number in the run's summary.json")):
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and says in lines[0], out.stderr
    assert not (tmp_path / "s.db").exists()


def test_the_objectives_a_jaxtrain_run_offers_are_its_summarys_numbers():
    """trials.SUMMARY_NUMBERS (checked before a sweep starts) against report.run_summary's keys, read from its
    source."""
    import ast
    import inspect

    from jaxtrain.driver import report
    from jaxtrain.sweep import trials as T

    returned = next(n.value for n in ast.walk(ast.parse(inspect.getsource(report.run_summary)))
                    if isinstance(n, ast.Return))
    keys = {k.value for k in returned.keys}
    words = {"experiment", "platform", "cpu_isa", "strategy", "precision", "accum", "remat", "dataset", "data_source",
             "data_sha256", "jax_version", "bottleneck"}
    assert set(T.SUMMARY_NUMBERS) == keys - words
    from jaxtrain.driver import language

    returned = next(n.value for n in ast.walk(ast.parse(inspect.getsource(language.summary)))
                    if isinstance(n, ast.Return))
    assert set(T.LANGUAGE_NUMBERS) == {k.value for k in returned.keys} - {"positions", "attention", "blocks"}


def test_a_language_models_objectives_are_its_summarys_numbers_too():
    # a new user's finding: --objective test_perplexity was refused for a GPT, whose summary.json holds it
    from jaxtrain.sweep import trials as T

    gpt = T.Command.parse(["python", "-m", "experiments.gpt", "--model-size", "tiny"], ())
    for objective in ("test_perplexity", "tokens_per_sec", "test_loss"):
        gpt.check_objective(objective)
    lenet = T.Command.parse(["python", "-m", "experiments.lenet"], ())
    with pytest.raises(ConfigError, match="--objective test_perplexity: not a number in the run's summary.json"):
        lenet.check_objective("test_perplexity")


def test_a_study_database_damaged_past_its_header_is_one_line(tmp_path, fake):
    """(BAD 4) 3,000 bytes overwritten inside a valid study: a 98-line traceback ending in Optuna's misleading
    "e.g. exceeding max length"."""
    import random

    db = tmp_path / "s.db"
    sweep("s", f"sqlite:///{db}", ["lr=log:1e-3:1"], 3, command=fake, say=quiet)
    data = bytearray(db.read_bytes())
    assert len(data) > 23000
    data[20000:23000] = random.Random(0).randbytes(3000)  # dd if=/dev/urandom bs=1 seek=20000 count=3000
    db.write_bytes(bytes(data))
    out = run_cli("-m", "jaxtrain.sweep", "--study", "s", "--storage", f"sqlite:///{db}", "--trials", "4", "--param",
                  "lr=log:1e-3:1", "--", *fake)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "the database is damaged (SQLite's quick_check: " in lines[0] and "restore it from a copy" in lines[0]


def _disk_full(monkeypatch, method: str) -> None:
    """From the second trial on, the storage's ``method`` fails as SQLite's writes do on a full disk (Optuna wraps
    the error raised by its commit)."""
    import sqlalchemy.exc

    storage = optuna.storages.RDBStorage
    real = getattr(storage, method)

    def failing(self, trial_id, *args, **kwargs):
        if self.get_trial(trial_id).number >= 1:
            full = sqlalchemy.exc.OperationalError("UPDATE trials", {}, sqlite3.OperationalError(
                "database or disk is full"))
            error = optuna.exceptions.StorageInternalError("An exception is raised during the commit. This "
                                                           "typically happens due to invalid data in the commit, "
                                                           "e.g. exceeding max length.")
            raise error from full
        return real(self, trial_id, *args, **kwargs)

    monkeypatch.setattr(storage, method, failing)


@pytest.mark.parametrize("fails, state, says", [
    (["set_trial_intermediate_value"], "FAIL", ""),
    (["set_trial_intermediate_value", "set_trial_state_values"], "RUNNING",
     "; trial(s) 1 left RUNNING: the same command run again marks them failed"),
])
def test_a_full_disk_under_the_database_is_one_line_and_says_what_is_left(tmp_path, fake, monkeypatch, fails, state,
                                                                          says):
    """(BAD 9) On a 20 MB tmpfs filled after the first trial: a 116-line traceback ending "AssertionError: Should
    not reach.", trial 1 left RUNNING. Here the storage's writes fail as SQLite's do there (mounting a tmpfs
    needs root); the trial is marked failed where the database still allows it, else the line says it is left."""
    from jaxtrain.errors import ConfigError

    for method in fails:
        _disk_full(monkeypatch, method)
    with pytest.raises(ConfigError) as error:
        sweep("s", f"sqlite:///{tmp_path}/s.db", ["lr=log:1e-3:1"], 3, command=fake, say=quiet)
    message = str(error.value)
    assert "\n" not in message and "the study database failed (database or disk is full)" + says in message, message
    assert message.endswith("free the space (or mend the server) and run the same command again to go on")
    assert _states(tmp_path / "s.db") == ["COMPLETE", state]


def wait_for(path, proc, what: str) -> None:
    """Until ``path`` exists; fails if ``proc`` ends first. The deadline is a safety net only (seconds here)."""
    deadline = time.monotonic() + 600
    while not path.exists():
        assert proc.poll() is None, f"{what}: the sweep ended first:\n" + proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{what}: not within 600 s"
        time.sleep(0.05)


def test_sigterm_stops_a_sweep_as_ctrl_c_does_and_its_trial_gets_one_signal(tmp_path, fake):
    """(MINOR) SIGTERM to the sweep's process group (a scheduler's, timeout(1)'s) exited 143 with no message, and
    the trial's run got two SIGTERMs (the group's, then its dying parent's) and took the hard-exit path."""
    db, events = tmp_path / "s.db", tmp_path / "events"
    argv = [sys.executable, "-m", "jaxtrain.sweep", "--study", "t", "--storage", f"sqlite:///{db}", "--trials", "2",
            "--param", "lr=log:1e-3:1", "--", *fake]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "FAKE_WAIT_FOR_SIGNAL": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(events / "waiting", proc, "the trial's run waiting for a signal")
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=600)[0]  # a safety net: it stops at once
    assert proc.returncode == 143, out
    assert out.strip().splitlines()[-1] == ("python -m jaxtrain.sweep: SIGTERM received: stopped; trial(s) 0 stopped, "
                                            "marked failed, their settings queued again; run the same command to go on")
    assert (events / "signals").read_text() == "SIGTERM\n"  # once, from the sweep
    assert _states(db) == ["FAIL", "WAITING"]  # its settings, queued for the next run


def test_a_trial_whose_tracker_failed_is_said_in_the_sweeps_lines_and_report(tmp_path, fake, monkeypatch):
    """(BAD 11) A tracking failure was only in the trial's own log; the sweep exited 0 and said nothing."""
    monkeypatch.setenv("FAKE_TRACK_FAILS", "1")
    said = []
    sweep("s", f"sqlite:///{tmp_path}/s.db", ["lr=log:1e-3:1"], 2, command=fake,
          say=lambda *a, **k: said.append(" ".join(map(str, a))))
    text = "\n".join(said)
    assert text.count("warning: its tracker stopped logging (--track mlflow: OperationalError: disk I/O error)") == 2
    assert "warning: the tracker stopped logging in trial(s) 0, 1" in text, text
    assert "tracker stopped logging in trial(s) 0, 1" in (tmp_path / "s" / "sweep.md").read_text()


def test_two_sweeps_started_at_once_on_a_new_database_both_run(tmp_path, fake):
    """(MINOR) The second failed with "table studies already exists" (or a UNIQUE constraint on alembic_version):
    both made the database's tables. Now they take turns (dirlock.taking_turns)."""
    argv = [sys.executable, "-m", "jaxtrain.sweep", "--study", "s", "--storage", f"sqlite:///{tmp_path}/new.db",
            "--trials", "2", "--param", "lr=log:1e-3:1", "--", *fake]
    sweeps = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outs = [s.communicate(timeout=600)[0] for s in sweeps]  # a safety net: each ends in seconds
    assert [s.returncode for s in sweeps] == [0, 0], outs
    assert _states(tmp_path / "new.db") == ["COMPLETE", "COMPLETE"]


def test_a_tracked_sweep_makes_its_mlflow_store_before_its_trials(tmp_path, monkeypatch):
    """(BAD 11) Parallel trials raced to make the study's mlflow.db; the sweep now makes it, and the experiment its
    trials log to, before any trial starts."""
    from mlflow.tracking import MlflowClient

    from jaxtrain.sweep import trials as T
    from jaxtrain.sweep.command import _prepare_tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cmd = T.Command.parse(["python", "-m", "experiments.lenet", "--track", "mlflow"], ["lr"])
    env = cmd.trial_env(tmp_path)
    _prepare_tracking(cmd, env, "study")
    experiment = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_experiment_by_name("study")
    assert experiment is not None and experiment.artifact_location == (tmp_path / "mlartifacts").as_uri()


def test_a_storage_that_is_a_folder_or_cannot_hold_its_lock_and_a_study_name_that_is_no_name_are_one_line(
        tmp_path, monkeypatch):
    # a new user's findings: IsADirectoryError and FileNotFoundError tracebacks; --study '' wrote its trials
    # straight into the storage's folder (runs/ itself by default)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="folder is a directory; give a file, e.g. sqlite:///.*/folder/sweeps.db"):
        S.storage_of(f"sqlite:///{tmp_path}/folder")
    def no_lock(path):  # a folder that takes no new files (/proc), whoever runs the test
        raise OSError(2, "No such file or directory")

    monkeypatch.setattr(S, "taking_turns", no_lock)
    with pytest.raises(ConfigError, match=r"cannot write beside .*/x.db \(No such file or directory\)"):
        S.storage_of(f"sqlite:///{tmp_path}/x.db")
    monkeypatch.undo()
    for name in ("", " ", "..", "a/b"):
        with pytest.raises(ConfigError, match="give a name, without /"):
            sweep(name, f"sqlite:///{tmp_path}/s.db", ["lr=log:1e-3:1"], command=["python", "-m", "experiments.lenet"])
    assert not (tmp_path / "s.db").exists()
