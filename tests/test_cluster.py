"""Against a real SLURM and Open MPI on this host (``make cluster`` starts them: tools/cluster): every launch path
gives the 1-process result, an allocation's own shell runs as one process, preemption and time limits requeue
and resume to the same parameters. Without the daemons these skip with the reason; under CI=true they fail."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import ROOT, cached_compiles, needs_fashion_mnist, reported_digests, run_cli

pytestmark = [needs_fashion_mnist, pytest.mark.slow, pytest.mark.cluster]

LENET = ["-m", "experiments.lenet", "--test-subset", "256", "--no-progress"]
STEPS = ["--max-steps", "8"]
HANG_SECONDS = 600  # a safety net only: the tests wait on the jobs' ends


def scheduler_missing() -> str | None:
    """Why the cluster tests cannot run here, or None."""
    for tool in ("srun", "sbatch", "scontrol", "sinfo", "mpirun"):
        if not shutil.which(tool):
            return f"{tool} not installed (make cluster installs and starts SLURM and Open MPI)"
    state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if state.returncode or state.stdout.strip() not in ("idle", "mix", "alloc"):
        return f"no SLURM node ready: {(state.stderr or state.stdout).strip()[:200]} (make cluster starts one)"
    return None


@pytest.fixture(scope="module", autouse=True)
def scheduler():
    reason = scheduler_missing()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI=true and the cluster tests cannot run: {reason}")
    if reason:
        pytest.skip(reason)


def job_env(**more) -> dict:
    """What a user's shell would pass to srun / sbatch / mpirun: no test-only device count, no jaxtrain launch."""
    env = {k: v for k, v in cached_compiles(os.environ).items() if not k.startswith(("JAX_NUM_CPU", "JAXTRAIN_"))}
    return {**env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **more}


def run(*command, **more) -> subprocess.CompletedProcess:
    out = subprocess.run(command, cwd=ROOT, env=job_env(**more), capture_output=True, text=True, timeout=HANG_SECONDS)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> str:
    """The reference: 1 process x 2 devices."""
    out_dir = tmp_path_factory.mktemp("one")
    out = run_cli(*LENET, *STEPS, "--devices", "2", "--out", str(out_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((out_dir / "summary.json").read_text())["params_digest"]


def test_srun_gives_the_one_process_result(tmp_path, one_process):
    out = run("srun", "-n", "2", sys.executable, *LENET, *STEPS, "--devices-per-process", "1", "--out", str(tmp_path))
    assert reported_digests(out.stdout) == {one_process}, out.stdout[-3000:]
    assert len(re.findall(r"process \d: params_digest", out.stdout)) == 2


def test_an_sbatch_job_runs_its_shell_as_one_process_and_its_srun_step_as_two(tmp_path, one_process):
    """The allocation's own shell once crashed: SLURM_NTASKS=2 without an srun step (JAX: no coordinator)."""
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2 --output={tmp_path}/job.out
set -e
cd {ROOT}
{sys.executable} {' '.join(LENET + STEPS)} --devices 2 --out {tmp_path}/shell
srun {sys.executable} {' '.join(LENET + STEPS)} --devices-per-process 1 --out {tmp_path}/step
""")
    run("sbatch", "--wait", str(script))
    log = (tmp_path / "job.out").read_text()
    assert "note: in a SLURM allocation of 2 tasks but not in an srun step: running as one process" in log
    assert reported_digests(log) == {one_process}, log[-3000:]
    assert len(re.findall(r"process \d: params_digest", log)) == 2  # the step's two


def test_mpirun_gives_the_one_process_result_unbound_and_says_why_not_when_bound(tmp_path, one_process):
    mpirun = ["mpirun", "--allow-run-as-root", "-np", "2"]
    lenet = [sys.executable, *LENET, *STEPS, "--devices-per-process", "1"]
    free = run(*mpirun, "--bind-to", "none", *lenet, "--out", str(tmp_path / "free"))
    assert reported_digests(free.stdout) == {one_process}, free.stdout[-3000:]
    bound = run(*mpirun, *lenet, "--out", str(tmp_path / "bound"))  # Open MPI binds each rank to a core
    said = "may run on 1 of the" in bound.stdout  # a note: a progress line, on stdout
    assert said or reported_digests(bound.stdout) == {one_process}, (bound.stdout + bound.stderr)[-3000:]
    if said:  # one line, naming the way out
        assert "mpirun --bind-to none (srun --cpu-bind=none) keeps them equal" in bound.stdout


# Preemption and time limits. A run of this length takes ~70-100 s on our machines (2 processes x 1 device): past
# the time-limit test's warning (~49 s in) on any of them. 600 steps once finished in ~48 s on an idle Xeon, before
# SLURM's warning: never requeued, that test failed.
LONG = ["--max-steps", "1000", "--checkpoint-every", "100"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    out_dir = tmp_path_factory.mktemp("long")
    out = run_cli(*LENET, *LONG[:2], "--devices", "2", "--out", str(out_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((out_dir / "summary.json").read_text())["params_digest"]


def submit(tmp_path, *options: str) -> str:
    """A 2-task job written by ``python -m jaxtrain.slurm`` (the script the docs show), submitted; its id."""
    out = run(sys.executable, "-m", "jaxtrain.slurm", "--checkpoint-dir", str(tmp_path / "ck"), "--tasks-per-node",
              "2", "--output", str(tmp_path / "job.out"), "--script", str(tmp_path / "job.sbatch"), "--submit",
              *options, "--", sys.executable, *LENET, *LONG, "--devices-per-process", "1", "--out", str(tmp_path / "o"))
    return re.search(r"Submitted batch job (\d+)", out.stdout).group(1)


def job_state(job: str) -> dict:
    shown = run("scontrol", "show", "job", job, "-o").stdout
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def wait_until(what, ready, job: str):
    """Wait for ``ready()`` (the job's state or files), the job's own log in the message if it never is."""
    deadline = time.monotonic() + HANG_SECONDS
    while not ready():
        assert time.monotonic() < deadline, f"{what}: {job_state(job)}"
        time.sleep(0.5)


def finished(tmp_path, job: str, log=None) -> dict:
    wait_until("the job did not end", lambda: job_state(job)["JobState"] in ENDED, job)
    state = job_state(job)
    assert state["JobState"] == "COMPLETED", (state, (log or tmp_path / "job.out").read_text()[-4000:])
    return state


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]


def test_scontrol_requeue_mid_run_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted):
    job = submit(tmp_path)
    wait_until("no checkpoint", lambda: (tmp_path / "ck" / "100").is_dir(), job)
    run("scontrol", "requeue", job)  # as a preemption does: SIGTERM to every task, the job back in the queue
    state = finished(tmp_path, job)
    log = (tmp_path / "job.out").read_text()
    assert int(state["Restarts"]) == 1 and "resuming from step" in log, log[-3000:]
    assert reported_digests(log) == {uninterrupted}, log[-3000:]
    stops = [r for r in rows(tmp_path) if r.get("event") == "stopped"]
    assert [(s["signal"], s["job"]["restart_count"], s["requeue"]) for s in stops] == [
        ("SIGTERM", 0, "not requeued: SIGTERM")]  # the scheduler requeued it, not the run
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["slurm_job"]["job_id"] == job and summary["slurm_job"]["restart_count"] == 1
    assert summary["stops"] == stops


def test_a_job_past_its_time_limit_checkpoints_requeues_itself_and_finishes(tmp_path, uninterrupted):
    """--time=00:01:00 --signal=B:USR1@5, a run of ~70-100 s: warned, it checkpoints, requeues its job, and the next
    start goes on (warned again on a slow machine, requeued again). SLURM checks time limits every 30 s and warns
    at the first check with at most signal + 30 s left: @30 or @15 warned each start ~19 s in (~7 s of training
    after its start-up; a start-up slowed by a busy machine would never reach a step), @5 ~49 s in, with 11 s left
    for the checkpoint and the requeue."""
    job = submit(tmp_path, "--time", "00:01:00", "--signal-seconds", "5")
    state = finished(tmp_path, job)
    log = (tmp_path / "job.out").read_text()
    assert int(state["Restarts"]) >= 1 and "requeued the job: scontrol requeue " + job in log, log[-3000:]
    assert reported_digests(log) == {uninterrupted}, log[-3000:]
    stops = [r for r in rows(tmp_path) if r.get("event") == "stopped"]
    assert stops and all(s["signal"] == "SIGUSR1" and s["requeue"] == f"scontrol requeue {job}" for s in stops)
    epochs = [r for r in rows(tmp_path) if "event" not in r]
    assert {r["job"]["id"] for r in epochs} == {job}


def test_a_job_array_of_sweep_workers_finishes_each_trial_once_when_one_task_is_requeued(tmp_path):
    """Two array tasks work on one Optuna study; one is requeued while its trial runs: its sweep stops the trial,
    queues its settings again and exits; SLURM starts the task again and the settings are trained once more."""
    import optuna

    storage = f"sqlite:///{tmp_path}/sweeps.db"
    script = tmp_path / "array.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --array=0-1 --ntasks=1 --cpus-per-task=1 --requeue --output={tmp_path}/task-%a.out --open-mode=append
cd {ROOT}
exec {sys.executable} -m jaxtrain.sweep --study array --storage {storage} --trials 2 --param lr=log:0.05:0.5 \\
    --dir {tmp_path}/trials -- {sys.executable} {' '.join(LENET)} --devices 1 --max-steps 150
""")
    job = re.search(r"Submitted batch job (\d+)", run("sbatch", str(script)).stdout).group(1)
    trial_logs = tmp_path / "trials"
    wait_until("two trials never ran at once", lambda: len(list(trial_logs.glob("trial-*/trial.log"))) == 2,
               f"{job}_1")
    run("scontrol", "requeue", f"{job}_1")
    for task in ("0", "1"):
        finished(tmp_path, f"{job}_{task}", log=tmp_path / f"task-{task}.out")
    assert int(job_state(f"{job}_1")["Restarts"]) == 1
    trials = optuna.load_study(study_name="array", storage=storage).trials
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(done) == 2 and len({t.params["lr"] for t in done}) == 2, [(t.state, t.params) for t in trials]
    assert len(failed) == 1 and failed[0].params["lr"] in {t.params["lr"] for t in done}  # its settings: once more


VISIBLE = ("import jax, jaxtrain as jt; jt.setup_devices(devices_per_process=1); "
           "print('visible', jax.process_index(), jax.config.read('jax_cuda_visible_devices'))")


def test_under_srun_each_task_is_given_the_gpus_its_scheduler_gave_it():
    """JAX alone gives each task its rank on the node ("0", "1"), whatever the task was given: with one GPU
    each (CUDA_VISIBLE_DEVICES=3 in each), task 1 would ask for a GPU it cannot see."""
    def visible(**env):
        out = run("srun", "-n", "2", sys.executable, "-c", VISIBLE, **env)
        return sorted(line for line in out.stdout.splitlines() if line.startswith("visible"))

    assert visible(CUDA_VISIBLE_DEVICES="2,3") == ["visible 0 0", "visible 1 1"]  # one list for both: a share each
    assert visible(CUDA_VISIBLE_DEVICES="3") == ["visible 0 0", "visible 1 0"]  # fewer than the tasks: their own
