"""An sbatch script for a run (``python -m jaxtrain.slurm``): nodes, tasks, GPUs, time, requeue and the signal.

The script starts the run with ``exec srun`` (so the warning signal the batch shell gets reaches every task),
checkpointing to ``--checkpoint-dir`` and resuming from it on every start, and asks the run to requeue its
own job after the signal's checkpoint: a job cut by a time limit or preempted goes on where it stopped until it
is done (docs/cluster.md). ``script`` writes the text; the command line prints, writes or submits it.
"""

from jaxtrain.slurm.job import DEFAULT_OUT, Job, script

__all__ = ["DEFAULT_OUT", "Job", "script"]
