"""Settings from the environment: every ``JAXTRAIN_*`` variable, read once and checked, and ``XLA_FLAGS``.

Nothing else in jaxtrain reads the environment for its settings. ``current()``
reads the variables the first time it is asked and keeps them for the
process, so a step traced later sees the values the run started with; a bad
value is a one-line ``ConfigError`` naming the variable. Benchmarks and tests
change them with ``override(...)``. docs/settings.md has the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path

from jaxtrain.errors import ConfigError, named


def affinity() -> set[int]:
    """The CPUs this process may run on (a launcher may bind it to fewer than the machine has)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cores() -> int:
    """The cores this process may run on (its affinity), which thread counts are bounded by."""
    return len(affinity())


@dataclasses.dataclass(frozen=True)
class Settings:
    """One process's settings; each field's variable is ``VARIABLES[field]``."""

    xla_defaults: bool = False  # XLA's default CPU flags, not jaxtrain's (to compare with a new jaxlib)
    malloc: str = "keep"  # "keep": glibc keeps freed memory (jaxtrain.parallel.host_memory); "default": glibc's own
    coordinator: str | None = None  # the launcher's: HOST:PORT of process 0
    num_processes: int | None = None  # the launcher's: how many processes
    process_id: int | None = None  # the launcher's: this one's rank
    devices_per_process: int | None = None  # the launcher's: local devices of each
    join_timeout: float = 300.0  # seconds a process waits for the others to join
    no_materialize: bool = False  # remat.materialize off (to measure what it buys)
    onednn_threads: int | None = None  # oneDNN's threads per call (None: the cores over the devices at once)
    onednn_blocked: bool = False  # oneDNN's blocked layouts always (to measure the NHWC kernels)
    onednn_cache: Path = Path.home() / ".cache" / "jaxtrain" / "onednn"  # where the built library is kept
    index_cache: Path = Path.home() / ".cache" / "jaxtrain" / "folders"  # image folders' indexes (data.folder)
    jpeg_cache: Path = Path.home() / ".cache" / "jaxtrain" / "jpeg"  # where the built JPEG decoder is kept
    gpu_compiled: Path = Path.home() / ".cache" / "jaxtrain" / "gpu-compiled"  # GPU programs' text (gpu_validate)
    jpeg_decoder: str = "region"  # how image folders' JPEGs are decoded: region (data.jpeg) or pillow (whole)
    pallas_gpu: str = "auto"  # the kernels' GPU backend: auto, mosaic or triton
    pallas_interpret: str = "triton"  # which version of the kernels runs interpreted on CPUs: triton or mosaic
    command_buffers: str = "xla"  # a GPU's command buffers (CUDA graphs): xla (XLA's own choice), off, or loops


VARIABLES = {
    "xla_defaults": "JAXTRAIN_XLA_DEFAULTS", "malloc": "JAXTRAIN_MALLOC", "coordinator": "JAXTRAIN_COORDINATOR",
    "num_processes": "JAXTRAIN_NUM_PROCESSES", "process_id": "JAXTRAIN_PROCESS_ID",
    "devices_per_process": "JAXTRAIN_DEVICES_PER_PROCESS", "join_timeout": "JAXTRAIN_JOIN_TIMEOUT",
    "no_materialize": "JAXTRAIN_NO_MATERIALIZE", "onednn_threads": "JAXTRAIN_ONEDNN_THREADS",
    "onednn_blocked": "JAXTRAIN_ONEDNN_BLOCKED", "onednn_cache": "JAXTRAIN_ONEDNN_CACHE",
    "index_cache": "JAXTRAIN_INDEX_CACHE", "jpeg_cache": "JAXTRAIN_JPEG_CACHE", "jpeg_decoder": "JAXTRAIN_JPEG_DECODER",
    "gpu_compiled": "JAXTRAIN_GPU_COMPILED",
    "pallas_gpu": "JAXTRAIN_PALLAS_GPU", "pallas_interpret": "JAXTRAIN_PALLAS_INTERPRET",
    "command_buffers": "JAXTRAIN_COMMAND_BUFFERS",
}


def _flag(name: str, text: str) -> bool:
    if text.lower() in ("", "0", "false", "no"):
        return False
    if text.lower() in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{name}={text}: use 1 (on) or 0 (off), or unset it")


def _whole(name: str, text: str, low: int = 1, high: int | None = None, why: str = "") -> int:
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        upto = f" to {high}" if high is not None else " or more"
        raise ConfigError(f"{name}={text}: must be a whole number from {low}{upto}{why}")
    return int(text)


def address(name: str, text: str) -> str:
    """``text`` if it is HOST:PORT (a port from 1 to 65535), else a ConfigError naming ``name``."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{named(name, text)}: not HOST:PORT: give process 0's host and a free port "
                          "(e.g. 10.0.0.1:7777)")
    return text


def _choice(name: str, text: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise ConfigError(f"{name}={text!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    return text


def _malloc(name: str, text: str) -> str:
    if text.lower() not in ("", "default"):
        raise ConfigError(f"{name}={text}: unknown value: set {name}=default to keep glibc's malloc settings, or "
                          "unset it to keep freed memory in the process (docs/performance.md, \"Host memory\")")
    return text.lower() or "keep"


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={text}: must be a number of seconds above 0")
    return value


def _threads(name: str, text: str) -> int:
    n = cores()
    return _whole(name, text, 1, n, " (the cores this process may run on), or unset: the cores over the devices")


PARSERS = {
    "xla_defaults": _flag, "malloc": _malloc, "coordinator": address,
    "num_processes": _whole, "process_id": lambda name, text: _whole(name, text, 0),
    "devices_per_process": _whole, "join_timeout": _seconds, "no_materialize": _flag,
    "onednn_threads": _threads, "onednn_blocked": _flag, "onednn_cache": lambda name, text: Path(text),
    "index_cache": lambda name, text: Path(text), "jpeg_cache": lambda name, text: Path(text),
    "gpu_compiled": lambda name, text: Path(text),
    "jpeg_decoder": lambda name, text: _choice(name, text, ("region", "pillow")),
    "pallas_gpu": lambda name, text: _choice(name, text, ("auto", "mosaic", "triton")),
    "pallas_interpret": lambda name, text: _choice(name, text, ("triton", "mosaic")),
    "command_buffers": lambda name, text: _choice(name, text, ("xla", "off", "loops")),
}


def read(environ=None) -> Settings:
    """The settings ``environ`` (default: this process's environment) holds; an unset or empty variable keeps
    its default."""
    environ = os.environ if environ is None else environ
    given = {field: environ.get(name, "") for field, name in VARIABLES.items()}
    read_ = Settings(**{field: PARSERS[field](VARIABLES[field], text) for field, text in given.items() if text})
    if read_.num_processes and read_.process_id is not None and read_.process_id >= read_.num_processes:
        raise ConfigError(f"{VARIABLES['process_id']}={read_.process_id} but {VARIABLES['num_processes']}="
                          f"{read_.num_processes}: each process needs its own rank from 0 to {read_.num_processes - 1}")
    return read_


_current: Settings | None = None


def current() -> Settings:
    """This process's settings: read from the environment the first time, then kept."""
    global _current
    if _current is None:
        _current = read()
    return _current


@contextlib.contextmanager
def override(**changes):
    """These settings changed for the block (benchmarks that compare two values; tests)."""
    global _current
    before = current()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before


def launched(coordinator: str, num_processes: int, process_id: int, devices_per_process: int | None) -> dict:
    """The environment ``python -m jaxtrain.launch`` gives each process it starts: its own and these settings
    (without $JAX_NUM_CPU_DEVICES: each process's devices are ``devices_per_process``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{
        VARIABLES["coordinator"]: coordinator, VARIABLES["num_processes"]: str(num_processes),
        VARIABLES["process_id"]: str(process_id)})
    if devices_per_process is not None:
        env[VARIABLES["devices_per_process"]] = str(devices_per_process)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def add_xla_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """Add ``flags`` to ``$XLA_FLAGS`` (before JAX starts: XLA reads it then), each unless ``$XLA_FLAGS`` already
    names it (yours take precedence) or JAXTRAIN_XLA_DEFAULTS is on; returns those added."""
    if current().xla_defaults:
        return ()
    given = os.environ.get("XLA_FLAGS", "")
    added = tuple(f for f in flags if f.split("=")[0] not in given)
    if added:
        os.environ["XLA_FLAGS"] = " ".join([given, *added]).strip()
    return added


def xla_flags() -> str:
    """``$XLA_FLAGS`` as it is now (jaxtrain's added)."""
    return os.environ.get("XLA_FLAGS", "")


# The settings read while a step is traced or compiled, or turned into XLA flags before JAX starts (command
# buffers): they change the program a run compiles, so a run records them (jaxtrain.driver.build.run_settings), and
# a resume under other values says which.
PROGRAM = ("xla_defaults", "no_materialize", "onednn_threads", "onednn_blocked", "pallas_gpu", "pallas_interpret",
           "command_buffers")


def program() -> dict:
    """What changes the compiled program outside a run's config, by the variable that sets it: the ``PROGRAM``
    settings and ``$XLA_FLAGS`` as it is now (jaxtrain's flags added)."""
    s = current()
    return {**{VARIABLES[name]: getattr(s, name) for name in PROGRAM}, "XLA_FLAGS": xla_flags()}


# Other programs' variables that jaxtrain follows, read here too (when asked: JAX reads them when it starts).

def jax_platforms() -> str:
    """``$JAX_PLATFORMS`` ("" where unset): JAX's platform choice before it starts."""
    return os.environ.get("JAX_PLATFORMS", "")


def jax_cpu_devices() -> int:
    """``$JAX_NUM_CPU_DEVICES``, 0 where unset."""
    text = os.environ.get("JAX_NUM_CPU_DEVICES", "")
    return _whole("JAX_NUM_CPU_DEVICES", text) if text else 0


def tfds_dir() -> str:
    """``$TFDS_DATA_DIR``, where TFDS keeps prepared datasets (default ~/tensorflow_datasets)."""
    return os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"


def cxx() -> str:
    """``$CXX``, the C++ compiler that builds jaxtrain's native code (oneDNN's convolutions, the JPEG decoder; g++)."""
    return os.environ.get("CXX") or "g++"


def include_path() -> list[str]:
    """``$CPATH`` and ``$CPLUS_INCLUDE_PATH``: where else that compiler looks for headers."""
    return [p for var in ("CPATH", "CPLUS_INCLUDE_PATH") for p in os.environ.get(var, "").split(":") if p]


# What JAX's own cluster detection needs (jax._src.clusters: OmpiCluster, then SlurmCluster).
OMPI_VARIABLES = ("OMPI_MCA_orte_hnp_uri",)  # Open MPI 4's ORTE; Open MPI 5 (PRRTE) sets none
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")  # srun's


@dataclasses.dataclass(frozen=True)
class Job:
    """The scheduler's job this process is a task of: ``launcher`` ("Open MPI", "SLURM"; "" outside one), its
    ``tasks``, and the variables JAX needs to join them that are ``missing``."""

    launcher: str = ""
    tasks: int = 1
    missing: tuple[str, ...] = ()


def cluster_job() -> Job:
    """This process's job, checked in JAX's order: Open MPI (``OMPI_COMM_WORLD_SIZE``), then SLURM
    (``SLURM_NTASKS``, which the batch step of an allocation has too; only an srun step has every variable)."""
    for launcher, size, needs in (("Open MPI", "OMPI_COMM_WORLD_SIZE", OMPI_VARIABLES),
                                  ("SLURM", "SLURM_NTASKS", SLURM_VARIABLES)):
        text = os.environ.get(size, "")
        if text.isdigit() and int(text) > 1:
            return Job(launcher, int(text), tuple(name for name in needs if name not in os.environ))
    return Job()


def check_job(job: Job) -> None:
    """A job JAX joins (``cluster_job``, nothing missing): its rank among its tasks, and Open MPI's coordinator, in
    the form JAX reads them; else a ConfigError naming the variable (JAX's own errors are tracebacks)."""
    rank, size, how = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun") if job.launcher == "Open MPI" else
                       ("SLURM_PROCID", "SLURM_NTASKS", "srun"))
    if rank not in os.environ:
        raise ConfigError(f"this process is one of {job.tasks} {job.launcher} tasks, but {rank} is not set: start "
                          f"the tasks with {how}")
    _whole(rank, os.environ[rank], 0, job.tasks - 1, f" ({size}={job.tasks}): start the tasks with {how}")
    uri = os.environ.get(OMPI_VARIABLES[0], "")
    if job.launcher == "Open MPI" and not (uri.split(".", 1)[0].isdigit()
                                           and re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)):
        raise ConfigError(f"{OMPI_VARIABLES[0]}={uri}: not Open MPI 4's form (JOBID.RANK;tcp://IP:PORT...): start "
                          f"the tasks with mpirun, or pass {named('coordinator', 'HOST:PORT')}, "
                          f"{named('num_processes')} and {named('process_id')}")


def tasks_on_node() -> tuple[int, int] | None:
    """(this task's rank on its node, the job's tasks on that node) in an srun step or an Open MPI job, else None.
    SLURM says the second per node: ``SLURM_STEP_TASKS_PER_NODE`` like ``2(x3),1``, indexed by ``SLURM_NODEID``."""
    env = os.environ
    if env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "").isdigit():
        return int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")), int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "")
    if not per_node or not env.get("SLURM_LOCALID", "").isdigit():
        return None
    counts = []
    for part in per_node.split(","):
        count, _, times = part.partition("(x")
        if not count.isdigit() or not (times.rstrip(")") or "1").isdigit():
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={per_node}: not SLURM's form (e.g. 2(x3),1); run the "
                              "tasks with srun, or unset it")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    node = int(env.get("SLURM_NODEID", "0") or 0)
    if node >= len(counts):
        raise ConfigError(f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={per_node} names {len(counts)} "
                          "node(s): run the tasks with srun")
    return int(env["SLURM_LOCALID"]), counts[node]


def slurm_job() -> dict | None:
    """The SLURM job this process runs in (``SLURM_JOB_ID``; array jobs: ``SLURM_ARRAY_JOB_ID`` and
    ``SLURM_ARRAY_TASK_ID``) and how often it was requeued (``SLURM_RESTART_COUNT``); None outside SLURM."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return {"job_id": env["SLURM_JOB_ID"], "requeue_id": f"{array}_{task}" if array and task else env["SLURM_JOB_ID"],
            "restart_count": int(env.get("SLURM_RESTART_COUNT") or 0)}


def jax_local_device_ids() -> str:
    """``$JAX_LOCAL_DEVICE_IDS`` ("" where unset): the user's own choice of this process's GPUs, JAX's to read."""
    return os.environ.get("JAX_LOCAL_DEVICE_IDS", "")


def gpus_per_task() -> int | None:
    """``$SLURM_GPUS_PER_TASK`` (srun's ``--gpus-per-task``: each task sees its own), None where unset."""
    text = os.environ.get("SLURM_GPUS_PER_TASK", "")
    return int(text) if text.isdigit() else None


def cuda_visible_devices() -> list[str] | None:
    """``$CUDA_VISIBLE_DEVICES`` as a list (a scheduler sets it to the GPUs it gave the task), None where unset."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if text is None else [d for d in text.split(",") if d.strip()]


# The trackers' own variables (W&B's, MLflow's): theirs to define; read here like ours, when a tracker opens.
TRACKER_VARIABLES = ("WANDB_PROJECT", "WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "NETRC", "MLFLOW_TRACKING_URI",
                     "MLFLOW_EXPERIMENT_NAME", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT",
                     "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")


def tracker(name: str, default: str | None = None) -> str | None:
    """A tracker's own variable (one of ``TRACKER_VARIABLES``) as it is set now, else ``default``."""
    if name not in TRACKER_VARIABLES:
        raise ValueError(f"{name} is not a tracker's variable jaxtrain reads: add it to TRACKER_VARIABLES")
    return os.environ.get(name, default)


def default_tracker(name: str, value: str) -> None:
    """Set a tracker's variable where the user has not (MLflow reads its HTTP waits from the environment)."""
    tracker(name)
    os.environ.setdefault(name, value)


def environment() -> dict[str, str]:
    """The whole environment, copied: what a child process (a sweep's trial) starts from."""
    return dict(os.environ)
