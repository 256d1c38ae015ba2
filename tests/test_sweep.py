"""jaxtrain.sweep: --param specs, the trial's command, pruning a running trial, and a study that survives a kill."""

import json
import os
import re
import signal
import sqlite3
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, cached_compiles, needs_fashion_mnist, run_cli

from jaxtrain.errors import ConfigError
from jaxtrain.sweep import trial_run as R, trials as T

optuna = pytest.importorskip("optuna")


@pytest.mark.parametrize("spec, name, kind, values", [
    ("lr=log:1e-3:1", "lr", "log", (1e-3, 1.0)),
    ("--batch-size=choice:128,256", "batch_size", "choice", (128, 256)),
    ("optimizer=choice:sgd,adamw", "optimizer", "choice", ("sgd", "adamw")),
    ("weight_decay=float:0:0.01", "weight_decay", "float", (0.0, 0.01)),
    ("accum_steps=int:1:4", "accum_steps", "int", (1, 4)),
    ("summary=choice:true,false", "summary", "choice", (True, False)),
])
def test_a_param_spec_names_a_run_setting_and_its_values(spec, name, kind, values):
    assert T.parse_param(spec) == T.Param(name, kind, values)
    assert T.parse_param(T.parse_param(spec).spec()) == T.parse_param(spec)


@pytest.mark.parametrize("spec, says", [
    ("lr=1e-3", "write NAME=KIND:VALUES"),
    ("lr=loguniform:1:2", "write NAME=KIND:VALUES"),
    ("batchsize=choice:64,128", "did you mean batch_size?"),
    ("lr=log:1:1e-3", "expected LO < HI"),
    ("lr=log:0:1", "LO > 0"),
    ("lr=log:1e-3:inf", "give finite bounds"),
    ("weight_decay=float:-inf:0.1", "give finite bounds"),
    ("lr=float:nan:1", "give finite bounds"),
    ("lr=int:1:3", "lr is a real number; use log:LO:HI or float:LO:HI"),
    ("optimizer=log:1:3", "optimizer is not a number; use choice:A,B"),
    ("batch_size=log:16:512", "batch_size is a whole number; use int:LO:HI"),
    ("batch_size=choice:128,big", "batch_size takes a whole number, got 'big'"),
    ("optimizer=choice:sgd,lion", "optimizer='lion': not one of"),
    ("accum_steps=int:0:4", "accum_steps=0: expected a number >= 1"),
    ("out=choice:a,b", "--out is not swept: each trial writes to its own folder"),
    # a new user's finding: a swept --checkpoint-dir was refused only after its first trial had trained
    ("checkpoint_dir=choice:/tmp/a", "--checkpoint-dir is not swept: trials would write over each other's"),
    ("resume=choice:true,false", "--resume is not swept"),
    ("model=choice:lenet,resnet18", "--model is not swept: a sweep trains one model"),
])
def test_a_bad_param_spec_is_one_line_saying_what_to_write(spec, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        T.parse_param(spec)


@pytest.mark.parametrize("argv, says", [
    ([], "no command to sweep"),
    (["python", "-m", "experiments.lenet", "--epohcs", "3"], "unrecognized arguments: --epohcs 3"),
    (["python", "-m", "experiments.lenet", "--lr", "0.1"], "the command sets --lr, which --param sweeps"),
    (["python", "-m", "experiments.lenet", "--out", "x"], "the command sets --out"),
    (["python", "-m", "experiments.lenet", "--checkpoint-dir", "ck"], "the command sets --checkpoint-dir"),
    (["/nonexistent/cmd", "--epochs", "3"], "command not found: /nonexistent/cmd"),
    (["no-such-program-here"], "command not found: no-such-program-here"),
    # a model with no experiments module: parsed as the run parses it (cli.run_config), not left to fail every trial
    (["python", "-m", "experiments.resnet50"], "python -m experiments.resnet50: not a training run"),
])
def test_a_bad_command_is_one_line(argv, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        T.Command.parse(argv, ["lr"])


def test_the_trial_and_best_command_lines_are_the_clis_own(tmp_path):
    cmd = T.Command.parse(["python", "-m", "experiments.lenet", "--epochs", "3", "--track", "mlflow"], ["lr"])
    assert cmd.model == "lenet"
    argv = cmd.trial_argv({"lr": 0.05, "summary": True}, tmp_path / "trial-0001", "study")
    assert argv[3:] == ["--epochs", "3", "--track", "mlflow", "--lr", "0.05", "--summary", "--out",
                        str(tmp_path / "trial-0001"), "--track-group", "study"]
    assert cmd.best_line({"lr": 0.05}) == "python -m experiments.lenet --epochs 3 --lr 0.05 --track mlflow"
    assert cmd.trial_env(tmp_path)["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path}/mlflow.db"
    own = T.Command.parse(["python", "train.py", "--steps", "9"], ["lr"])  # not a jaxtrain run: passed through
    assert own.model is None and own.trial_argv({"lr": 0.5}, tmp_path, "s")[2:] == ["--steps", "9", "--lr", "0.5",
                                                                                    "--out", str(tmp_path)]


def test_a_swept_value_is_checked_with_the_commands_own_settings():
    """A distillation's alpha is swept where the command has --teacher (it was refused when each value was checked
    alone: alpha needs a teacher), and refused before any trial where it has none."""
    teacher = T.Command.parse(["python", "-m", "jaxtrain.cli", "--model", "lenet", "--teacher", "runs/t"], ["alpha"])
    teacher.check_param(T.parse_param("alpha=float:0.1:0.9"))
    plain = T.Command.parse(["python", "-m", "experiments.lenet"], ["alpha"])
    with pytest.raises(ConfigError, match=r"--param 'alpha=float:0.1:0.9' with the command's settings: alpha=0.1: "
                                          r"distillation's, with teacher=RUN_DIR"):
        plain.check_param(T.parse_param("alpha=float:0.1:0.9"))
    T.Command.parse(["python", "train.py"], ["alpha"]).check_param(T.parse_param("alpha=float:0.1:0.9"))  # not ours
    # a value that needs another swept setting's (the review's finding: image_size with a swept folder dataset)
    folders = T.parse_param("dataset=choice:folder:/a,folder:/b")
    sizes = T.parse_param("image_size=int:28:64")
    plain.check_param(sizes, [folders, sizes])
    with pytest.raises(ConfigError, match=r"image_size=int:28:64.* with the command.s settings: image_size= is "
                                          r"for image folders"):
        plain.check_param(sizes, [sizes])


def test_the_console_command_is_the_sweeps_own_and_its_runs_are_checked_as_jaxtrains():
    """A new user's finding: `-- jaxtrain lenet ...` failed with "command not found: jaxtrain" unless the venv was
    activated (`-- python` was already the sweep's own interpreter)."""
    cmd = T.Command.parse(["jaxtrain", "lenet", "--epochs", "3"], ["lr"])
    assert cmd.argv == (sys.executable, "-m", "jaxtrain.cli", "--model", "lenet", "--epochs", "3")
    assert cmd.model == "lenet" and cmd.best_line({"lr": 0.05}) == ("python -m jaxtrain.cli --model lenet --epochs 3 "
                                                                   "--lr 0.05")
    assert T.Command.parse(["jaxtrain", "train", "--model", "vit"], ["lr"]).model == "vit"
    assert T.Command.parse(["python", "-m", "jaxtrain", "lenet"], ["lr"]).argv == cmd.argv[:5]  # the same run
    for argv, says in ((["jaxtrain"], "the command jaxtrain : not a training run; give jaxtrain RECIPE"),
                       (["jaxtrain", "gpu-plan"], "the command jaxtrain gpu-plan: not a training run"),
                       (["jaxtrain", "lenet", "--model", "vit"], "its recipe is the model; drop --model")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            T.Command.parse(argv, ["lr"])
    with pytest.raises(ConfigError, match="the command sets --lr, which --param sweeps"):  # checked as a run's flags
        T.Command.parse(["jaxtrain", "lenet", "--lr", "0.1"], ["lr"])


FAKE_RUN = textwrap.dedent("""
    import json, pathlib, sys, time
    out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
    for epoch, acc in enumerate(map(float, sys.argv[1].split(",")), 1):
        (out / "metrics.jsonl").open("a").write(json.dumps({"epoch": epoch, "test_acc": acc}) + "\\n")
        time.sleep(0.3)
    time.sleep(float(sys.argv[2]))
    (out / "summary.json").write_text(json.dumps({"test_acc": acc}))
""")


def test_a_trial_reports_each_epoch_and_a_hopeless_one_is_stopped(tmp_path):
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.MedianPruner(n_startup_trials=2))

    def trial(accs, linger, prune=True):
        t = study.ask()
        out = tmp_path / f"trial-{t.number}"
        try:
            value = R.run(t, [sys.executable, str(script), accs, str(linger), "--out", str(out)], out, "test_acc", {},
                          prune, poll=0.1)
        except optuna.TrialPruned:
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
            return None
        study.tell(t, value)
        return value

    assert trial("0.5,0.7,0.8", 0) == 0.8 and trial("0.6,0.7,0.9", 0) == 0.9
    # worse than the median at epoch 1: stopped, not waited for. Its run would linger 600 s before its summary (a
    # safety net: were it not stopped, it would end with its summary and the test fail, not hang)
    assert trial("0.1,0.2,0.3", 600) is None
    assert not (tmp_path / "trial-2" / "summary.json").exists()
    pruned = study.trials[2]
    assert pruned.state == optuna.trial.TrialState.PRUNED and pruned.intermediate_values[1] == 0.1
    assert study.trials[0].intermediate_values == {1: 0.5, 2: 0.7, 3: 0.8}
    (tmp_path / "crash.py").write_text("raise SystemExit('out of memory')")
    t = study.ask()
    with pytest.raises(R.TrialFailed, match="exit code 1: out of memory"):
        R.run(t, [sys.executable, str(tmp_path / "crash.py")], tmp_path / "c", "test_acc", {}, True, poll=0.1)


def test_a_storage_that_is_not_writable_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")  # its folder cannot be made: a file is in the way
    out = run_cli("-m", "jaxtrain.sweep", "--study", "s", "--storage", f"sqlite:///{tmp_path}/file/s.db", "--param",
                  "lr=log:1e-3:1", "--", "python", "-m", "experiments.lenet")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"--storage sqlite:///{tmp_path}/file/s.db: cannot make {tmp_path}/file" in out.stderr, out.stderr


def _states(db) -> list[str]:
    with sqlite3.connect(db) as con:
        return [s for (s,) in con.execute("SELECT state FROM trials ORDER BY number")]


def _states_so_far(db) -> list[str]:
    """``_states`` while the sweep starts: [] before optuna has made the file and its tables (the file comes
    first: a poll in between read "no such table: trials" on a loaded machine)."""
    try:
        return _states(db) if db.exists() else []
    except sqlite3.OperationalError as e:
        if "no such table" in str(e):
            return []
        raise


@needs_fashion_mnist
@pytest.mark.slow
def test_a_sweep_killed_in_its_middle_goes_on_to_its_trials_with_nothing_finished_run_again(tmp_path):
    import subprocess

    db = tmp_path / "sweeps.db"
    argv = [sys.executable, "-m", "jaxtrain.sweep", "--study", "lenet-lr", "--storage", f"sqlite:///{db}",
            "--trials", "6", "--param", "lr=log:3e-4:3e-2", "--param", "batch_size=choice:64,128", "--",
            "python", "-m", "experiments.lenet", "--devices", "1", "--epochs", "1", "--train-subset", "2048",
            "--test-subset", "512", "--optimizer", "adam", "--track", "mlflow"]
    env = cached_compiles(os.environ)
    for name in ("JAX_NUM_CPU_DEVICES", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    sweep = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Kill it while trial 2 runs, two finished before it: once trial 2's run is a process. The deadline is a safety
    # net only (2 trials take about a minute on a loaded 2-core machine).
    deadline, states, running = time.monotonic() + 1200, [], []
    while not running and time.monotonic() < deadline and sweep.poll() is None:
        states = _states_so_far(db)
        if states.count("COMPLETE") == 2 and states[-1:] == ["RUNNING"]:
            running = [p for p in os.listdir("/proc") if p.isdigit() and "trial-0002" in _cmdline(p)]
        time.sleep(0.2)
    if not running:
        sweep.kill()
        pytest.fail(f"the sweep never got to its third trial ({states}):\n" + sweep.communicate()[0][-3000:])
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    finished_before = {p.parent.name: p.stat().st_mtime for p in (tmp_path / "lenet-lr").glob("trial-*/summary.json")}
    assert sorted(finished_before) == ["trial-0000", "trial-0001"]
    for pid in running:  # the killed trial's run got SIGTERM with its sweep (PR_SET_PDEATHSIG) and stops
        _wait_gone(pid)

    again = run_cli(*argv[1:], env={"MLFLOW_TRACKING_URI": None}, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trial(s) 2: their sweep was killed; marked failed, settings queued again" in again.stdout
    states = _states(db)
    assert states.count("COMPLETE") == 6 and states[2] == "FAIL" and len(states) == 7, states
    study = optuna.load_study(study_name="lenet-lr", storage=f"sqlite:///{db}")
    assert study.trials[3].params == study.trials[2].params  # the killed trial's settings, run once more
    for name, mtime in finished_before.items():  # nothing finished was run again
        assert (tmp_path / "lenet-lr" / name / "summary.json").stat().st_mtime == mtime
    table = [ln for ln in again.stdout.splitlines() if re.match(r"\| \d+ \| complete \|", ln)]
    values = [float(ln.split("|")[3]) for ln in table]
    assert len(values) == 6 and values == sorted(values, reverse=True), again.stdout  # best first
    assert f"best: trial {study.best_trial.number}, test_acc {study.best_value:.4f}" in again.stdout
    best_line = again.stdout.split("\nbest: trial", 1)[1].splitlines()[1].strip()
    assert len(set(values)) > 1, again.stdout  # the trials learned, differently
    assert best_line.startswith("python -m experiments.lenet --devices 1 --epochs 1") and "--lr " in best_line
    for png in ("history.png", "importances.png", "slice.png"):
        assert (tmp_path / "lenet-lr" / png).read_bytes()[:4] == b"\x89PNG", png

    from mlflow.tracking import MlflowClient  # each trial tracked, grouped by study, in the study's store

    client = MlflowClient(f"sqlite:///{tmp_path / 'lenet-lr' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lenet-lr").experiment_id])
    finished = sorted(r.info.run_name for r in runs if r.info.status == "FINISHED")
    assert finished == sorted(p.parent.name for p in (tmp_path / "lenet-lr").glob("trial-*/summary.json"))
    assert len(finished) == 6 and "trial-0002" not in finished  # the killed one: KILLED, or never opened


def _wait_gone(pid: str) -> None:
    """Until process ``pid`` has exited (gone, or a zombie nobody reaped). The deadline is a safety net only: a run
    stops on SIGTERM within seconds (its start-up exits at once; training checkpoints nothing here)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.1)
    pytest.fail(f"the killed sweep's trial (pid {pid}) still runs 600 s after its sweep died")


def _cmdline(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture
def in_process(monkeypatch):
    """A sweep run from Python here: its trials' environment (the compile cache; each trial its own devices), and
    (the lines it says, its say)."""
    for name, value in cached_compiles({}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    said = []
    return said, lambda *a, **k: said.append(" ".join(map(str, a)))


@needs_fashion_mnist
@pytest.mark.slow
def test_a_sweep_from_python_over_a_run_config(tmp_path, in_process):
    from jaxtrain import RunConfig
    from jaxtrain.sweep.command import sweep

    said, say = in_process
    base = RunConfig(model="lenet", devices=1, epochs=1, train_subset=512, test_subset=256, optimizer="adam")
    study = sweep("py", f"sqlite:///{tmp_path}/s.db", ["lr=log:1e-3:1e-2"], trials=2, base=base, say=say)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"], "\n".join(said)
    summary = json.loads((tmp_path / "py" / "trial-0000" / "summary.json").read_text())
    assert summary["train_examples"] == 512 and summary["lr"] in [t.params["lr"] for t in study.trials]
    best = [ln for text in said for ln in text.splitlines() if ln.startswith("  python -m jaxtrain.cli")]
    line = (f"  python -m jaxtrain.cli --model lenet --devices 1 --epochs 1 --lr {study.best_params['lr']} "
            "--train-subset 512 --test-subset 256 --optimizer adam")  # RunConfig's field order
    assert best == [line], said



@needs_fashion_mnist
@pytest.mark.slow
def test_a_trial_that_diverges_in_its_last_step_is_never_best(tmp_path, in_process):
    """(issue 64) --lr 1e6 for 2 steps: every loss read was finite, the evaluation NaN; the trial was complete and
    printed as best: with its command line to copy."""
    from jaxtrain import RunConfig
    from jaxtrain.sweep.command import sweep

    said, say = in_process
    base = RunConfig(model="lenet", devices=2, epochs=1, max_steps=2, train_subset=512, test_subset=256)
    study = sweep("d", f"sqlite:///{tmp_path}/s.db", ["lr=choice:1e6"], trials=1, base=base, say=say)
    assert [t.state.name for t in study.trials] == ["PRUNED"], "\n".join(said)
    assert "training diverged" in study.trials[0].user_attrs["diverged"]
    assert not any("best:" in text for text in said), said

def test_parallel_trials_share_the_cores_between_them():
    import shutil

    from jaxtrain.sweep.command import slots

    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU machine: trials share its GPUs")
    cores = sorted(os.sched_getaffinity(0))
    assert slots(1) == [{}]  # one trial at a time: the whole machine
    if len(cores) >= 2:
        shares = [s["cores"] for s in slots(2)]
        assert sorted(c for s in shares for c in s) == cores and all(shares)
    with pytest.raises(ConfigError, match=f"--parallel {len(cores) + 1}: only {len(cores)} CPU cores to share"):
        slots(len(cores) + 1)
