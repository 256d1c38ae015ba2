"""Join the processes of a multi-process run: ``jax.distributed``, started from our flags, our launcher's
environment, or a SLURM / Open MPI job (detected as JAX detects it), each process given the GPUs its task was
given."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import jax

from jaxtrain import settings
from jaxtrain.io import console
from jaxtrain.errors import ConfigError, named

log = logging.getLogger(__name__)

# A dead peer must end the run within a minute, not after JAX's default 100 s.
HEARTBEAT_TIMEOUT_SECONDS = 30


def _in_cluster() -> bool:
    """True inside a multi-task SLURM / Open MPI job that jax.distributed detects itself. A SLURM allocation's
    own shell (an sbatch script, salloc) is not an srun step: it runs as one process and says so. A job JAX
    cannot join (a variable it needs is missing) is a ConfigError naming it."""
    job = settings.cluster_job()
    if not job.missing:
        if job.tasks > 1:
            settings.check_job(job)
        return job.tasks > 1
    if job.launcher == "SLURM" and "SLURM_STEP_NODELIST" in job.missing:
        log.info(f"note: in a SLURM allocation of {job.tasks} tasks but not in an srun step: running as one "
                 f"process (srun python ... starts {job.tasks})")
        return False
    how = ("start the tasks with srun" if job.launcher == "SLURM" else
           "JAX finds Open MPI 4's coordinator only (Open MPI 5 sets none)")
    raise ConfigError(f"this process is one of {job.tasks} {job.launcher} tasks, but {', '.join(job.missing)} is not "
                      f"set, which JAX needs to join them: {how}, or pass {named('coordinator', 'HOST:PORT')}, "
                      f"{named('num_processes', job.tasks)} and {named('process_id', 'RANK')}")


def start(coordinator, num_processes, process_id) -> None:
    """Start jax.distributed for a multi-process run (flags, our launcher's env, or a cluster's)."""
    launched = settings.current()  # what `python -m jaxtrain.launch` set for this process, if it started it
    if (coordinator or process_id is not None) and not (num_processes or launched.num_processes or _in_cluster()):
        given = named("coordinator", coordinator) if coordinator else named("process_id", process_id)
        raise ConfigError(f"{given}: for a multi-process run; give {named('num_processes')} too (or start it with "
                          "python -m jaxtrain.launch, srun or mpirun)")
    coordinator = coordinator or launched.coordinator
    num_processes = num_processes or launched.num_processes
    if process_id is None:
        process_id = launched.process_id
    single = num_processes == 1 or (num_processes is None and not _in_cluster())
    if single or jax.distributed.is_initialized():
        return  # a single-process run stays exactly as it was
    if num_processes is not None and (coordinator is None or process_id is None):
        raise ConfigError(f"a multi-process run needs {named('coordinator', 'HOST:PORT')} and "
                          f"{named('process_id')} too (or start it with python -m jaxtrain.launch)")
    if num_processes is not None:
        settings.address("coordinator", coordinator)
        if process_id >= num_processes:
            raise ConfigError(f"{named('process_id', process_id)} but {named('num_processes', num_processes)}: "
                              "each process needs its "
                              f"own rank from 0 to {num_processes - 1}")
    _join(coordinator, num_processes, process_id)


def _join(coordinator, num_processes, process_id) -> None:
    """jax.distributed.initialize, saying what it waits for; peers that never join end the run with one line.

    JAX's own timeout aborts the process with a C++ stack dump, so ours comes first: after
    $JAXTRAIN_JOIN_TIMEOUT seconds (default 300, JAX's) a message and exit 2.
    """
    import threading

    timeout = settings.current().join_timeout
    who = f"process {process_id} of {num_processes}" if num_processes else "this process"
    where = f" at {coordinator}" if coordinator else ""

    def waiting():
        log.info(f"{who}: waiting for the other processes to join{where} (up to {timeout:.0f} s; "
                 f"${settings.VARIABLES['join_timeout']} sets it) ...")

    def give_up():
        log.error(f"{who}: the other processes did not join{where} within {timeout:.0f} s: start all of them "
                  "(python -m jaxtrain.launch starts them together) with the same --coordinator")
        console.exit_now(2)

    joined = threading.Event()

    def watch():  # one thread, so the waiting line always comes before the give-up, however late it runs
        first = min(10.0, timeout / 2)
        if not joined.wait(first):
            waiting()
            if not joined.wait(timeout - first):
                give_up()

    threading.Thread(target=watch, daemon=True, name="jaxtrain-join").start()
    try:  # CPU runs use the gloo collectives (JAX's default for CPU); GPUs use NCCL.
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids(),
                                   initialization_timeout=int(timeout) + 60,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS)
    finally:
        joined.set()


def gpus_on_node() -> int:
    """The node's NVIDIA GPUs, counted before JAX starts: their device files (/dev/nvidia0, ...)."""
    return sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


def local_device_ids(gpus: int | None = None) -> list[int] | None:
    """The GPUs this process drives, as ``jax.distributed.initialize`` numbers them (None: JAX's choice).

    JAX's SLURM and Open MPI detection gives each process one GPU, its rank on the node (jax-ml/jax#16788),
    so a task given 8 GPUs would drive one. Here: $JAX_LOCAL_DEVICE_IDS, where set, decides (JAX reads it).
    Else $CUDA_VISIBLE_DEVICES (CUDA numbers its GPUs from 0): all of them where they are this task's own (one
    task on the node, fewer than its tasks, or as many as $SLURM_GPUS_PER_TASK), else this task's share of
    them. Else one task on its node: every GPU of the node ([]: nothing restricted, whatever the vendor). Else
    the node's NVIDIA GPUs split evenly over its tasks (fewer GPUs than tasks, or none found: JAX's choice)."""
    on_node = settings.tasks_on_node()
    if on_node is None or settings.jax_local_device_ids():
        return None
    rank, tasks = on_node
    visible = settings.cuda_visible_devices()
    if visible is not None:
        if tasks == 1 or len(visible) < tasks or settings.gpus_per_task() == len(visible):
            return list(range(len(visible)))
        return _share(len(visible), rank, tasks)
    if tasks == 1:
        return []
    gpus = gpus_on_node() if gpus is None else gpus
    return None if gpus < tasks else _share(gpus, rank, tasks)


def _share(gpus: int, rank: int, tasks: int) -> list[int]:
    each = gpus // tasks
    return list(range(rank * each, (rank + 1) * each))
