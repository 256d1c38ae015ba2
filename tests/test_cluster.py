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
from pathlib import Path

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
    said = "may run on 1 of the" in bound.stderr
    assert said or reported_digests(bound.stdout) == {one_process}, bound.stderr[-3000:]
    if said:  # one line, naming the way out
        assert "mpirun --bind-to none keeps them equal" in bound.stderr
