"""``python -m jaxtrain.slurm [OPTIONS] -- COMMAND ...``: an sbatch script for a run, printed, written or
submitted (``jaxtrain.slurm.script``)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from jaxtrain.cli import one_line_errors, run_config
from jaxtrain.slurm import Job, script

USAGE = ("%(prog)s --checkpoint-dir DIR [--nodes N] [--tasks-per-node T] [--gpus-per-task G] "
         "[--time HH:MM:SS] [--dry-run | --submit] -- python -m experiments.NAME ...")


def parser(prog: str = "python -m jaxtrain.slurm") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, usage=USAGE, description=(
        "Write an sbatch script that runs COMMAND with srun on every task, checkpoints to --checkpoint-dir, resumes "
        "on every start, and requeues its own job when warned before its time limit (or preempted)."))
    p.add_argument("--checkpoint-dir", required=True, help="where the run checkpoints (shared by every node)")
    p.add_argument("--name", default="jaxtrain", help="the job's name (default %(default)s)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default %(default)s)")
    p.add_argument("--tasks-per-node", type=int, default=1,
                   help="processes per node (default %(default)s: one process drives all of a node's GPUs)")
    p.add_argument("--gpus-per-task", type=int, help="GPUs per process (default: the cluster's)")
    p.add_argument("--cpus-per-task", type=int, help="CPU cores per process: the input pipeline's decode workers")
    p.add_argument("--time", help="time limit, [D-]HH:MM:SS (default: the partition's)")
    p.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    p.add_argument("--account", help="SLURM account to charge (default: yours)")
    p.add_argument("--output", default="%x-%j.out", help="the job's log, appended to on every start "
                                                          "(default %(default)s: name-jobid.out)")
    p.add_argument("--signal-seconds", type=int, default=120,
                   help="send USR1 this many seconds before the time limit: the run checkpoints and requeues "
                        "(default %(default)s; SLURM may send it up to a minute early)")
    p.add_argument("--no-requeue", action="store_true", help="end when warned or preempted instead of requeueing")
    p.add_argument("--script", help="write the script here (default: NAME.sbatch)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    how.add_argument("--submit", action="store_true", help="write the script, then submit it with sbatch")
    return p


def time_limit(text: str) -> int | None | bool:
    """``--time`` in SLURM's forms (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> seconds; True for
    UNLIMITED / INFINITE; None: not one of them."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return True
    days, dash, rest = text.rpartition("-") if "-" in text else ("", "", text)
    parts = rest.split(":")
    if not (days.isdecimal() or not dash) or not all(p.isdecimal() for p in parts) or len(parts) > 3:
        return None
    numbers = [int(p) for p in parts]
    if dash:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (numbers + [0, 0])[:3]
        hours += 24 * int(days)
    elif len(numbers) == 3:  # HH:MM:SS
        hours, minutes, seconds = numbers
    else:  # MM or MM:SS
        hours, (minutes, seconds) = 0, (numbers + [0])[:2]
    if len(numbers) > 1 and (numbers[-1] > 59 or len(numbers) == 3 and numbers[1] > 59):
        return None
    return (hours * 60 + minutes) * 60 + seconds


@one_line_errors("python -m jaxtrain.slurm")
def main(argv=None, prog: str = "python -m jaxtrain.slurm") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = parser(prog)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        p.error("give the run's command after --, e.g. -- python -m experiments.resnet18 --epochs 90")
    for name in ("nodes", "tasks_per_node", "gpus_per_task", "cpus_per_task", "signal_seconds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(a.split("=")[0] in ("--checkpoint-dir", "--resume", "--requeue-on-signal") for a in command):
        p.error("leave --checkpoint-dir, --resume and --requeue-on-signal out of the command: the script adds them")
    for name in ("name", "time", "partition", "account", "output", "checkpoint_dir"):
        value = getattr(args, name)
        if value is not None and (not value or any(c.isspace() for c in value)):
            p.error(f"--{name.replace('_', '-')} {value!r}: give a value without spaces")
    if args.time is not None:  # SLURM would refuse the script at sbatch, or warn after the job's end
        limit = time_limit(args.time)
        if limit is None:
            p.error(f"--time {args.time}: expected SLURM's form, [D-]HH:MM:SS (or MM, MM:SS, D-HH, D-HH:MM), e.g. "
                    "12:00:00 or 2-00:00:00")
        if limit is not True and args.signal_seconds >= limit:
            p.error(f"--signal-seconds {args.signal_seconds} is not before the end of --time {args.time}: give fewer "
                    "seconds, or a longer time")
    if len(command) > 1 and command[1] == "-m":  # a module: a training run, its flags checked as it checks them
        run_config(command, ["--checkpoint-dir", args.checkpoint_dir, "--resume"]
                   + ([] if args.no_requeue else ["--requeue-on-signal"]))
    job = Job(tuple(command), args.checkpoint_dir, args.name, args.nodes, args.tasks_per_node, args.gpus_per_task,
              args.cpus_per_task, args.time, args.partition, args.account, args.output, args.signal_seconds,
              not args.no_requeue)
    text = script(job)
    if args.dry_run:
        print(text, end="")
        return 0
    path = Path(args.script or f"{args.name}.sbatch")
    replaced = path.exists()
    path.write_text(text)
    print(f"wrote {path}" + (" (it replaced the script there)" if replaced else ""))
    if not args.submit:
        print(f"submit it with: sbatch {path}")
        return 0
    if shutil.which("sbatch") is None:
        print("error: sbatch is not on PATH: submit the script from a SLURM login node", file=sys.stderr)
        return 2
    done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    print((done.stdout or done.stderr).strip(), file=sys.stdout if done.returncode == 0 else sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
