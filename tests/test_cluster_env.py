"""Clusters as their environment shows them, without a scheduler: detection as JAX's own, a SLURM allocation's
shell, a job JAX cannot join, the GPUs each task drives, and the host's cores shared by processes however started.

(tests/test_cluster.py runs the same against a real SLURM and Open MPI.)"""

import os
import re
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, cached_compiles, needs_fashion_mnist, run_cli

from jaxtrain import settings
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import hosts, processes

SCHEDULER_VARIABLES = ("SLURM_", "OMPI_", "PMI", "CUDA_VISIBLE_DEVICES", "JAX_LOCAL_DEVICE_IDS")
SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2"}


@pytest.fixture
def env(monkeypatch):
    """A clean scheduler environment to set variables in."""
    for name in list(os.environ):
        if name.startswith(SCHEDULER_VARIABLES):
            monkeypatch.delenv(name)

    def set_(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_


ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}  # an sbatch script's own shell
CASES = {
    "srun step": SRUN_STEP, "allocation, no step": ALLOCATION, "one task": {**SRUN_STEP, "SLURM_NTASKS": "1"},
    "open mpi 4": {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "1.2:tcp://127.0.0.1:5000"},
    "open mpi 5": {"OMPI_COMM_WORLD_SIZE": "2"}, "mpirun inside an allocation": {
        **ALLOCATION, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "1.2:tcp://127.0.0.1:5000"},
    "step without its rank": {k: v for k, v in SRUN_STEP.items() if k != "SLURM_LOCALID"}, "none": {},
}


@pytest.mark.parametrize("case", CASES)
def test_a_job_is_joined_exactly_where_jax_detects_one(env, case):
    from jax._src.clusters import OmpiCluster, SlurmCluster

    env(**CASES[case])
    job = settings.cluster_job()
    jax_joins = OmpiCluster.is_env_present() or SlurmCluster.is_env_present()
    assert (job.tasks > 1 and not job.missing) == (jax_joins and job.tasks > 1)


def test_a_job_jax_cannot_join_is_one_line_naming_the_variable(env, monkeypatch):
    env(OMPI_COMM_WORLD_SIZE="2")  # Open MPI 5: no ORTE URI, so JAX finds no coordinator
    with pytest.raises(ConfigError, match=r"one of 2 Open MPI tasks, but OMPI_MCA_orte_hnp_uri is not set") as e:
        processes.start(None, None, None)
    assert "\n" not in str(e.value) and "coordinator=HOST:PORT" in str(e.value)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    env(**{k: v for k, v in SRUN_STEP.items() if k != "SLURM_PROCID"})
    with pytest.raises(ConfigError, match=r"SLURM_PROCID is not set.*srun"):
        processes.start(None, None, None)


@needs_fashion_mnist
@pytest.mark.slow
def test_a_run_in_an_allocation_but_outside_srun_runs_as_one_process(tmp_path):
    """It ended in JAX's ValueError "coordinator_address should be defined" (SLURM_NTASKS=2, no srun step)."""
    out = run_cli("-m", "experiments.lenet", "--devices", "2", "--max-steps", "1", "--test-subset", "256",
                  "--no-progress", "--out", str(tmp_path / "o"), env=ALLOCATION)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: in a SLURM allocation of 2 tasks but not in an srun step: running as one process" in out.stdout


@pytest.mark.parametrize("given, gpus, expected", [
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1"}, 8, []),  # every GPU (JAX alone: [0])
    ({"SLURM_LOCALID": "1"}, 8, [4, 5, 6, 7]),  # 2 tasks on the node: half each
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "6,7", "SLURM_GPUS_PER_TASK": "2"}, 8, [0, 1]),  # its own two
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 8, [2, 3]),  # one list for both tasks: its share
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "5"}, 8, [0]),  # fewer than the tasks: bound per task
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, 4, []),  # the 4th node: 1 task, every GPU
    ({"JAX_LOCAL_DEVICE_IDS": "3"}, 8, None),  # the user's: JAX reads it
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1"}, 0, []),  # one task, no NVIDIA GPU: unrestricted
    ({"SLURM_STEP_TASKS_PER_NODE": "4"}, 2, None),  # fewer GPUs than tasks: JAX's one per task
])
def test_each_task_drives_the_gpus_it_was_given(env, given, gpus, expected):
    env(**{**SRUN_STEP, **given})
    assert processes.local_device_ids(gpus) == expected


def test_outside_a_job_jax_chooses_the_gpus(env):
    assert processes.local_device_ids(8) is None


@pytest.mark.parametrize("per_node, node", [("2(xa)", "0"), ("two", "0"), ("2(x3)", "5")])
def test_a_malformed_srun_step_is_one_line_naming_the_variable(env, per_node, node):
    env(**{**SRUN_STEP, "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NODEID": node})
    with pytest.raises(ConfigError, match="SLURM_"):
        processes.local_device_ids(8)


def test_a_host_share_counts_the_cores_of_all_its_processes():
    mine = hosts._mine(1)
    other_host = mine.copy()
    other_host[0] += 1
    assert hosts.share_of([mine, mine], 0) == hosts.Share(2, settings.cores(), settings.cores(), 2)
    assert hosts.share_of([mine, other_host], 1) == hosts.Share(1, settings.cores(), settings.cores(), 1)
    one_core = mine.copy()
    one_core[hosts._MASK] = 0
    one_core[5] = hosts.np.packbits(hosts.np.eye(1, hosts.MAX_CPUS, 0, hosts.np.uint8)).view(hosts.np.int32)[0]
    bound = hosts.share_of([one_core, mine], 0)
    assert bound.own_cores == 1 and bound.bound == (settings.cores() > 1)


FAKE_SRUN = """
import jax, jaxtrain as jt
from jaxtrain.parallel import hosts
from jaxtrain.kernels import onednn_calls
jt.setup_devices(devices_per_process=1)
visible = jax.config.read("jax_cuda_visible_devices")
print("visible", visible, "share", hosts.current(), "threads", onednn_calls.threads())
"""


def fake_srun(nodes: int, **more):
    """Two processes with the environment srun gives 2 tasks (on one node, or one on each of two), on localhost."""
    port = next(p for p in range(61440 + os.getpid() % 4000, 65536) if _free(p))  # JAX's: 61440 + job id % 4096
    base = {k: v for k, v in cached_compiles(os.environ).items() if not k.startswith(SCHEDULER_VARIABLES + (
        "JAX_NUM_CPU", "JAXTRAIN_"))}
    procs = []
    for rank in range(2):
        env = {**base, **SRUN_STEP, "SLURM_JOB_ID": str(port - 61440), "SLURM_PROCID": str(rank),
               "SLURM_LOCALID": str(rank if nodes == 1 else 0), "SLURM_NODEID": str(0 if nodes == 1 else rank),
               "SLURM_STEP_TASKS_PER_NODE": "2" if nodes == 1 else "1(x2)",
               "SLURM_STEP_NODELIST": "localhost" if nodes == 1 else "localhost,localhost", **more}
        procs.append(subprocess.Popen([sys.executable, "-c", FAKE_SRUN], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    return [next(line for line in out.splitlines() if line.startswith("visible")) for out in outs]


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("localhost", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_under_srun_one_task_per_node_drives_every_gpu_and_a_host_shares_its_cores():
    """JAX's own choice was the task's rank on its node: "0" in each of one task per node (1 GPU of 8)."""
    one_each = fake_srun(nodes=2)
    assert all(line.startswith("visible all ") for line in one_each), one_each
    two_here = fake_srun(nodes=1, CUDA_VISIBLE_DEVICES="2,3,4,5", SLURM_GPUS_PER_TASK="4")  # each task: its own 4
    assert all(line.startswith("visible 0,1,2,3 ") for line in two_here), two_here
    # Both processes on this host, 1 device each: 2 devices share its cores, as 1 process x 2 devices would.
    cores = settings.cores()
    assert all(f"Share(devices=2, cores={cores}, own_cores={cores}, processes=2) threads {max(1, cores // 2)}"
               in line for line in two_here), two_here


def test_the_sbatch_script_asks_for_the_job_and_requeues_on_the_warning():
    from jaxtrain.slurm import Job, script

    text = script(Job(("python", "-m", "experiments.resnet18", "--lr", "0.1 x"), "$SCRATCH/ck", nodes=2,
                      gpus_per_task=8, time="24:00:00", account="lab"))
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-task=8",
                 "#SBATCH --time=24:00:00", "#SBATCH --account=lab", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --open-mode=append"):
        assert line in text.splitlines(), (line, text)
    assert "#SBATCH --partition" not in text  # unset: the cluster's default
    assert text.splitlines()[-1] == (  # the variables expand in the job; every start writes to one run directory
        "exec srun python -m experiments.resnet18 --lr '0.1 x' --checkpoint-dir \"$SCRATCH/ck\" --resume "
        '--out "runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}" --requeue-on-signal')
    once = script(Job(("python", "-m", "experiments.lenet", "--out=o"), "ck", requeue=False))
    assert "--requeue" not in once and "USR1" not in once
    assert once.splitlines()[-1].endswith("--out=o --checkpoint-dir ck --resume")  # its own --out kept


def test_the_sbatch_command_line_refuses_what_it_cannot_write():
    def cli(*args):
        return run_cli("-m", "jaxtrain.slurm", *args)

    printed = cli("--checkpoint-dir", "ck", "--dry-run", "--", "python", "-m", "experiments.lenet")
    assert printed.returncode == 0 and printed.stdout.startswith("#!/bin/bash"), printed.stderr
    for args, says in ((["--checkpoint-dir", "ck"], "give the run's command after --"),
                       (["--checkpoint-dir", "ck", "--", "python", "x.py", "--resume"], "leave --checkpoint-dir"),
                       (["--checkpoint-dir", "ck", "--", "python", "--checkpoint-dir=d"], "leave --checkpoint-dir"),
                       (["--checkpoint-dir", "ck", "--time", "1 00", "--", "python"], "--time '1 00': give a value"),
                       (["--checkpoint-dir", "ck", "--nodes", "0", "--", "python"], "--nodes must be >= 1"),
                       # a new user's findings: written as given, for sbatch to refuse, or to warn after the end
                       (["--checkpoint-dir", "ck", "--time", "abc", "--", "python"], "--time abc: expected "
                        "SLURM's form"),
                       (["--checkpoint-dir", "ck", "--time", "25:99:00", "--", "python"], "--time 25:99:00: expected"),
                       (["--checkpoint-dir", "ck", "--time", "00:01:00", "--signal-seconds", "300", "--", "python"],
                        "--signal-seconds 300 is not before the end of --time 00:01:00")):
        out = cli(*args)
        assert out.returncode == 2 and says in out.stderr.strip().splitlines()[-1], out.stderr


def test_the_sbatch_time_limit_reads_slurms_form_and_a_script_written_over_is_said(tmp_path):
    from jaxtrain.slurm.__main__ import time_limit

    assert [time_limit(t) for t in ("12:00:00", "2-00:00:30", "1:05:00", "168:00:00", "60", "30:00", "2-12",
                                    "2-12:30", "UNLIMITED")] == [43200, 172830, 3900, 604800, 3600, 1800, 216000,
                                                                 217800, True]  # SLURM's forms
    assert time_limit("12:60:00") is None and time_limit("abc") is None and time_limit("1-2-3") is None
    script = tmp_path / "job.sbatch"
    args = ["--checkpoint-dir", "ck", "--script", str(script), "--time", "01:00:00", "--", "python", "train.py"]
    said = [run_cli("-m", "jaxtrain.slurm", *args).stdout.splitlines()[0] for _ in range(2)]
    assert said == [f"wrote {script}", f"wrote {script} (it replaced the script there)"], said


@pytest.mark.parametrize(("command", "says"), [
    (["python", "-m", "experiments.resnet19"], "python -m experiments.resnet19: not a training run"),
    (["python", "-m", "experiments.lenet", "--epohcs", "3"], "unrecognized arguments: --epohcs 3"),
    (["python", "-m", "experiments.lenet", "--lr", "-1"], "--lr -1.0: expected a number > 0"),
    (["python", "-m", "jaxtrain.cli", "--model", "resnet99"], "argument --model: invalid choice: 'resnet99'"),
])
def test_the_sbatch_command_line_parses_the_run_as_the_run_would_before_writing(tmp_path, command, says):
    """(issue 64) A job for an unknown module or bad flags was written (and could be submitted), to fail on the
    cluster after its wait in the queue."""
    script = tmp_path / "job.sbatch"
    out = run_cli("-m", "jaxtrain.slurm", "--checkpoint-dir", "ck", "--script", str(script), "--", *command)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and says in out.stderr, out.stderr
    assert not script.exists()
    ok = run_cli("-m", "jaxtrain.slurm", "--checkpoint-dir", "ck", "--script", str(script), "--", "python", "-m",
                 "experiments.distill", "--teacher", "runs/t", "--student", "lenet", "--epochs", "2")
    assert ok.returncode == 0 and script.is_file(), ok.stderr


def test_requeue_on_signal_is_refused_at_start_where_it_could_not_requeue(env, monkeypatch, tmp_path):
    from jaxtrain.driver import requeue
    from jaxtrain.driver.config import RunConfig

    asked = RunConfig(model="lenet", requeue_on_signal=True, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(ConfigError, match="needs a SLURM job"):
        requeue.check(asked)
    env(SLURM_JOB_ID="41", SLURM_ARRAY_JOB_ID="40", SLURM_ARRAY_TASK_ID="1", SLURM_RESTART_COUNT="2")
    with pytest.raises(ConfigError, match="needs checkpoint_dir= and resume=True"):
        requeue.check(RunConfig(model="lenet", requeue_on_signal=True))
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with pytest.raises(ConfigError, match="needs SLURM's scontrol on PATH"):
        requeue.check(asked)
    (tmp_path / "scontrol").write_text("#!/bin/sh\n")
    (tmp_path / "scontrol").chmod(0o755)
    assert requeue.check(asked) == {"job_id": "41", "requeue_id": "40_1", "restart_count": 2}  # an array's task
    assert requeue.check(RunConfig(model="lenet")) is None


def test_a_resumed_run_keeps_the_rows_of_its_earlier_starts(env, tmp_path):
    from jaxtrain.driver.outputs import RunWriter
    from jaxtrain.train.loop import EpochStats

    def stats(epoch):
        return EpochStats(epoch, 10, 100, 1.0, 0.5, 1.0, 0.5, 50, 1.0, 0.1, 0.0, 0.0)

    first = RunWriter(tmp_path, job={"job_id": "7", "restart_count": 0})
    first.epoch(stats(1))
    first.epoch(stats(2))
    first.stopped(25, "SIGUSR1", True, "scontrol requeue 7")
    history = [first.rows[0]]  # the checkpoint holds epoch 1 only (epoch 2's row came after it)
    second = RunWriter(tmp_path, history, job={"job_id": "7", "restart_count": 1}, resumed=True)
    second.epoch(stats(2))
    assert [(r.get("epoch"), r.get("event"), r["job"]["restart_count"]) for r in second.rows] == [
        (1, None, 0), (None, "stopped", 0), (2, None, 1)]
    assert second.stops == [second.rows[1]] and len(second.epochs) == 2
    assert RunWriter(tmp_path).rows == []  # a fresh start keeps nothing


def test_the_preflight_names_a_slow_process_by_rank_and_host():
    from jaxtrain.parallel import preflight

    line = preflight.describe([0.002, 0.003, 0.002], [0.004, 0.005, 0.02], ["a", "a", "b"])
    assert line.startswith("preflight: 3 processes on 2 host(s): all-reduce 3.0 ms, matmul 512x512 4.0-20.0 ms")
    assert line.endswith("; slow: process 2 on b (20.0 ms, 4.0x the median)")
    assert "slow" not in preflight.describe([0.002] * 2, [0.004, 0.005], ["a", "a"])
    assert "slow" not in preflight.describe([1e-4] * 3, [2e-5, 2e-5, 9e-5], ["a"] * 3)  # a GPU's jitter: 70 us


def test_the_cluster_page_shows_what_the_generator_writes_for_its_command():
    """docs/cluster.md's sbatch script is the generator's output for the command beside it (the cluster tests
    submit the generator's output), but for the `cd` line, which names where it ran."""
    import contextlib
    import io
    import shlex
    from pathlib import Path

    from jaxtrain.slurm.__main__ import main

    page = (Path(ROOT) / "docs" / "cluster.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", page, flags=re.S)
    command = next(b for b in blocks if b.startswith("python -m jaxtrain.slurm"))
    shown = next(b for b in blocks if b.startswith("#!/bin/bash"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(shlex.split(command.replace("\\\n", " "))[3:]) == 0
    def without_cd(text):
        return [line for line in text.splitlines() if not line.startswith("cd ")]

    assert without_cd(printed.getvalue()) == without_cd(shown)


@pytest.mark.parametrize("variables, says", [
    ({**SRUN_STEP, "SLURM_PROCID": "5"}, r"^SLURM_PROCID=5: must be a whole number from 0 to 1 \(SLURM_NTASKS=2\): "
                                         r"start the tasks with srun$"),
    ({**SRUN_STEP, "SLURM_PROCID": "x"}, r"^SLURM_PROCID=x: must be a whole number from 0 to 1"),
    ({**CASES["open mpi 4"], "OMPI_COMM_WORLD_RANK": "2"}, r"^OMPI_COMM_WORLD_RANK=2: must be a whole number from 0 "
                                                           r"to 1 \(OMPI_COMM_WORLD_SIZE=2\): start the tasks with "
                                                           r"mpirun$"),
    (CASES["open mpi 4"], r"^this process is one of 2 Open MPI tasks, but OMPI_COMM_WORLD_RANK is not set"),
    ({**CASES["open mpi 4"], "OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_hnp_uri": "garbage"},
     r"^OMPI_MCA_orte_hnp_uri=garbage: not Open MPI 4's form .*pass coordinator=HOST:PORT"),
    ({**CASES["open mpi 4"], "OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_hnp_uri": "x.0;tcp://10.0.0.1:5000"},
     r"^OMPI_MCA_orte_hnp_uri=x.0;tcp://10.0.0.1:5000: not Open MPI 4's form"),
])
def test_a_jobs_inconsistent_variables_are_one_line_before_jax_starts(env, variables, says):
    """Issue 64: a rank beyond the job's tasks, or an Open MPI coordinator JAX cannot parse, were JAX's tracebacks
    (a ValueError, a RuntimeError) from inside jax.distributed."""
    env(**variables)
    with pytest.raises(ConfigError, match=says) as e:
        processes.start(None, None, None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("variables, says", [
    ({"JAXTRAIN_PROCESS_ID": "5", "JAXTRAIN_NUM_PROCESSES": "2"},
     r"^JAXTRAIN_PROCESS_ID=5 but JAXTRAIN_NUM_PROCESSES=2: each process needs its own rank from 0 to 1$"),
    ({"JAXTRAIN_COORDINATOR": "garbage"}, r"^JAXTRAIN_COORDINATOR=garbage: not HOST:PORT"),
    ({"JAXTRAIN_COORDINATOR": "localhost:99999"}, r"^JAXTRAIN_COORDINATOR=localhost:99999: not HOST:PORT"),
])
def test_the_launchers_inconsistent_variables_are_one_line_naming_them(variables, says):
    """Issue 64: JAXTRAIN_COORDINATOR=garbage was an IndexError (docs/settings.md promises a line naming it); a
    rank beyond the count was JAX's traceback."""
    with pytest.raises(ConfigError, match=says):
        settings.read(variables)
    assert settings.read({"JAXTRAIN_COORDINATOR": "[::1]:7777"}).coordinator == "[::1]:7777"


@pytest.mark.parametrize("given, says", [(("garbage", 2, 0), r"^coordinator=garbage: not HOST:PORT"),
                                         (("localhost:7777", 2, 5), r"^process_id=5 but num_processes=2: ")])
def test_inconsistent_process_flags_are_one_line(env, given, says):
    with pytest.raises(ConfigError, match=says):
        processes.start(*given)
