"""A SLURM job's settings (``Job``) and its sbatch script (``script``): the package's face,
``jaxtrain.slurm``, says what the script does."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path


DEFAULT_OUT = "runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"  # where a run writes without --out: the same on a requeue


@dataclasses.dataclass(frozen=True)
class Job:
    """What the script asks SLURM for; ``None`` leaves a setting to the cluster's defaults."""

    command: tuple[str, ...]  # the run, e.g. ("python", "-m", "experiments.resnet18", "--epochs", "90")
    checkpoint_dir: str
    name: str = "jaxtrain"
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None  # SLURM's [D-]HH:MM:SS
    partition: str | None = None
    account: str | None = None
    output: str = "%x-%j.out"  # %x: the job's name, %j: its id; appended to on each start
    signal_seconds: int = 120  # USR1 this long before the time limit (SLURM may send it up to a minute early)
    requeue: bool = True
    workdir: str = "."


def script(job: Job) -> str:
    """The sbatch script's text."""
    options = {"job-name": job.name, "nodes": job.nodes, "ntasks-per-node": job.tasks_per_node,
               "gpus-per-task": job.gpus_per_task, "cpus-per-task": job.cpus_per_task, "time": job.time,
               "partition": job.partition, "account": job.account, "output": job.output, "open-mode": "append"}
    lines = ["#!/bin/bash", "# Written by python -m jaxtrain.slurm (docs/cluster.md). Submit it with sbatch."]
    lines += [f"#SBATCH --{key}={value}" for key, value in options.items() if value is not None]
    run = [*job.command, "--checkpoint-dir", job.checkpoint_dir, "--resume"]
    if not any(arg == "--out" or arg.startswith("--out=") for arg in job.command):
        run += ["--out", DEFAULT_OUT]  # one run directory for every start of the job (its rows, its summary)
    if job.requeue:
        # USR1 to the batch shell, which is srun (exec): srun passes it on to every task. The run checkpoints,
        # stops and requeues the job (scontrol requeue), which starts again with the same id and resumes.
        lines += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{job.signal_seconds}"]
        run.append("--requeue-on-signal")
    lines += ["", 'echo "job $SLURM_JOB_ID start $((SLURM_RESTART_COUNT + 0)) on $SLURM_JOB_NODELIST"',
              f"cd {shlex.quote(str(Path(job.workdir).resolve()))}", "exec srun " + " ".join(map(_word, run)), ""]
    return "\n".join(lines)


def _word(arg: str) -> str:
    """``arg`` quoted for bash; one naming a variable (``$SCRATCH/ck``, ``${SLURM_JOB_ID}``) in double quotes,
    so the job expands it (a literal ``$`` in an argument: write it as ``\\$``)."""
    if "$" in arg and re.fullmatch(r"[\w@%+=:,./${}-]+", arg):
        return f'"{arg}"'
    return shlex.quote(arg)
