"""Pick the devices a run uses and build the mesh over them (named axes; "data" is the batch axis)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from jaxtrain import settings
from jaxtrain.io import console
from jaxtrain.core import compat
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel import host_memory, hosts, processes

log = logging.getLogger(__name__)

# The mesh axis names; every module imports them from here.
DATA_AXIS = "data"  # the batch is sharded over it (and replicated over every other axis)
MODEL_AXIS = "model"  # tensor parallelism: what the models' TP rules shard over
# A hybrid mesh's outer axis: data parallelism across processes (hosts, the slow network); the batch is split
# over it and "data" (within a process) together, and "hsdp" shards parameters over "data" only.
REPLICA_AXIS = "replica"


def batch_axes(mesh) -> str | tuple[str, ...]:
    """The mesh axes the batch is split over: ``"data"``, or ``("replica", "data")`` on a hybrid mesh."""
    return (REPLICA_AXIS, DATA_AXIS) if REPLICA_AXIS in mesh.axis_names else DATA_AXIS

# Virtual CPU devices share the cores; past a few per core they only add
# rendezvous overhead (and XLA:CPU's all-reduce rendezvous can starve).
CPU_DEVICES_PER_CORE = 4

# XLA:CPU flags (compat.CPU_XLA_FLAGS, chosen per jaxlib version and CPU vector ISA: why, and the
# measurements, are there) are added to $XLA_FLAGS before JAX starts (settings.add_xla_flags), unless $XLA_FLAGS
# already names them or JAXTRAIN_XLA_DEFAULTS=1 keeps XLA's defaults. They are CPU-only: the CPU compiler reads
# them, so a step compiled for a GPU never sees them. Where JAX will start on a GPU, JAXTRAIN_COMMAND_BUFFERS's
# flag is added the same way (compat.COMMAND_BUFFER_FLAGS). What was added: ``xla_flags_added()``.
_added: tuple[str, ...] = ()


def xla_flags_added() -> tuple[str, ...]:
    """The flags ``setup_devices`` added to $XLA_FLAGS in this process (the run's first line says them)."""
    return _added


def max_cpu_devices() -> int:
    """How many virtual CPU devices this machine may simulate."""
    return CPU_DEVICES_PER_CORE * settings.cores()


def _check_count(n: int | None) -> None:
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ConfigError(f"{named('devices', repr(n))}: must be a positive whole number")


@console.shown
def setup_devices(n: int | None = None, *, devices_per_process: int | None = None, coordinator: str | None = None,
                  num_processes: int | None = None, process_id: int | None = None) -> list[jax.Device]:
    """Return the ``n`` devices of this run; call before any other JAX call.

    CPU: ``n`` virtual devices (default: one per core, or $JAX_NUM_CPU_DEVICES),
    compiled with ``compat.cpu_xla_flags()`` added to $XLA_FLAGS (yours take precedence), with glibc's malloc
    set to keep freed memory (``host_memory``; $JAXTRAIN_MALLOC=default keeps glibc's defaults).
    GPU: the first ``n`` GPUs (default: all). Asking for more devices than
    exist, or calling after JAX started with a different count, raises a
    ``ConfigError`` that says what to do.

    Multi-process runs (``num_processes`` > 1, the environment set by
    ``python -m jaxtrain.launch``, or a SLURM / Open MPI job) start
    ``jax.distributed`` first; each process then has ``devices_per_process``
    local devices and ``n``, if given, must be the total over all processes.
    """
    _check_count(n)
    _check_count(devices_per_process)
    if devices_per_process is None:
        devices_per_process = settings.current().devices_per_process
    if not compat.backend_started():
        global _added
        _added = settings.add_xla_flags(compat.cpu_xla_flags() + _gpu_flags())
        if _platform_hint() == "cpu":
            host_memory.keep_freed_memory()  # before JAX's threads start (why: jaxtrain.parallel.host_memory)
        if devices_per_process is not None:
            jax.config.update("jax_num_cpu_devices", devices_per_process)
        processes.start(coordinator, num_processes, process_id)
    if jax.distributed.is_initialized() or devices_per_process is not None:
        devices = jax.devices()
        if jax.process_count() > 1:
            hosts.learn()  # which processes share this host's cores: thread counts follow
        if n is not None and n != len(devices):
            raise ConfigError(f"{named('devices', n)} does not match {jax.process_count()} processes x "
                              f"{jax.local_device_count()} devices per process = {len(devices)}; drop "
                              f"{named('devices')} or make them agree")
        return devices
    if not compat.backend_started():
        cpu_n = n if n is not None else settings.jax_cpu_devices() or settings.cores()
        if cpu_n > max_cpu_devices() and _platform_hint() == "cpu":
            raise ConfigError(
                f"{named('devices', cpu_n)} is more than this machine can simulate: at most "
                f"{max_cpu_devices()} virtual CPU devices on {settings.cores()} cores; ask for 1..{max_cpu_devices()}"
            )
        jax.config.update("jax_num_cpu_devices", cpu_n)
    devices = jax.devices()
    platform = devices[0].platform
    if n is None:
        return devices
    if platform == "cpu" and len(devices) < n:
        raise ConfigError(
            f"JAX already started with {len(devices)} CPU devices, so {n} cannot be set up now: "
            f"call jt.setup_devices({n}) before any other JAX call (in a notebook: restart the kernel, then call "
            f"it first), or set JAX_NUM_CPU_DEVICES={n}"
        )
    if platform == "cpu" and len(devices) > n:  # a notebook's 1-device run after its 2-device set-up, as on GPUs
        log.warning("using the first %d of the %d CPU devices JAX started with (they share the cores: a step's time "
                    "is not that of a %d-device start)", n, len(devices), n)
    if n > len(devices):
        raise ConfigError(
            f"{named('devices', n)} asked for, but only {len(devices)} {platform.upper()} device(s) exist; "
            f"use {named('devices', f'1..{len(devices)}')}"
        )
    return devices[:n]


GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # what JAX_PLATFORMS (or the plugin found) may call a GPU


def _gpu_flags() -> tuple[str, ...]:
    """JAXTRAIN_COMMAND_BUFFERS's flag (``compat.COMMAND_BUFFER_FLAGS``) where JAX will start on a GPU."""
    if _platform_hint() not in GPU_PLATFORMS:
        return ()
    mode = settings.current().command_buffers
    if compat.command_buffers_untested(mode):
        log.warning("%s=%s not set: its XLA flag's form is not known to parse in jaxlib %s (tested: %s); no flag "
                    "is added for it", settings.VARIABLES["command_buffers"], mode,
                    compat.installed_version_text("jaxlib"), compat.COMMAND_BUFFER_TESTED.removeprefix("jaxlib "))
    return compat.gpu_xla_flags(mode)


def _platform_hint() -> str:
    """Best guess of the default platform without starting JAX."""
    platforms = (jax.config.jax_platforms or settings.jax_platforms()).split(",")[0]
    if platforms:
        return platforms
    from importlib.util import find_spec

    has_gpu_plugin = any(find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin"))
    return "gpu" if has_gpu_plugin else "cpu"


def make_mesh(devices: int | Sequence[jax.Device] | Mesh | None = None, axes: Mapping[str, int] | None = None) -> Mesh:
    """A mesh over ``devices`` (a list, or the first N); a Mesh is returned as is.

    ``axes``: named axis sizes, e.g. ``{"data": 2, "model": 2}``, in mesh
    order; their product must be the number of devices. Default: one axis
    ``"data"`` over all of them. ``"data"`` is always the batch axis; left
    out, it comes first with the devices the others leave (``{"stage": 4}``
    on 8 devices is ``{"data": 2, "stage": 4}``). ``"replica"`` makes a hybrid
    mesh: always the outer axis, one replica per process where the devices
    span processes (JAX's ``create_hybrid_device_mesh``), the batch split over
    it and ``"data"`` together.
    """
    if isinstance(devices, Mesh):
        return devices
    available = jax.devices()
    if devices is None:
        devices = available
    elif isinstance(devices, int):
        _check_count(devices)
        if devices > len(available):
            raise ConfigError(
                f"a mesh of {devices} devices asked for, but JAX has {len(available)}; "
                f"call jt.setup_devices({devices}) first"
            )
        devices = available[:devices]
    devices = list(devices)
    axes = dict(axes) if axes else {DATA_AXIS: len(devices)}
    rest = math.prod(v for v in axes.values() if isinstance(v, int) and v >= 1)
    if DATA_AXIS not in axes and len(devices) % rest == 0:  # "data" takes the devices the others leave
        axes = {DATA_AXIS: len(devices) // rest, **axes}
    if REPLICA_AXIS in axes:  # the outer axis: across processes
        axes = {REPLICA_AXIS: axes.pop(REPLICA_AXIS), **axes}
    _check_axes(axes, len(devices))
    # Auto (GSPMD) axes: users' model code stays sharding-agnostic. With
    # Explicit axes a plain reshape of a batch-sharded array (e.g. a pooling
    # written as reshape+mean) is a ShardingTypeError unless annotated; the
    # trainer types the mesh for its strategy (``typed``).
    types = (AxisType.Auto,) * len(axes)
    if REPLICA_AXIS in axes and len({d.process_index for d in devices}) > 1:
        return Mesh(_hybrid(axes, devices), tuple(axes), axis_types=types)
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=types, devices=devices)


def _hybrid(axes: dict, devices: list):
    """The devices as a hybrid mesh: "replica" across processes, every other axis within one (JAX's helper puts
    each process's devices together on the inner axes)."""
    from jax.experimental import mesh_utils

    processes = len({d.process_index for d in devices})
    if axes[REPLICA_AXIS] != processes:
        raise ConfigError(f"mesh {REPLICA_AXIS}={axes[REPLICA_AXIS]}: a hybrid mesh has one replica per process, and "
                          f"this run has {processes} processes: use {REPLICA_AXIS}={processes}")
    inner = tuple(1 if k == REPLICA_AXIS else v for k, v in axes.items())
    outer = tuple(v if k == REPLICA_AXIS else 1 for k, v in axes.items())
    return mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=True)


def typed(mesh: Mesh, explicit: bool) -> Mesh:
    """``mesh`` with every axis Explicit (``strategy="explicit"``: each array's sharding is part of its type) or
    Auto (every other strategy: GSPMD propagates shardings); the same devices and names."""
    kind = AxisType.Explicit if explicit else AxisType.Auto
    if all(t == kind for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(kind,) * len(mesh.axis_names))


def _check_axes(axes: dict, num_devices: int) -> None:
    shown = ",".join(f"{k}={v}" for k, v in axes.items())
    if DATA_AXIS not in axes:
        raise ConfigError(f"mesh {shown} has no {DATA_AXIS!r} axis: the batch is sharded over it (add {DATA_AXIS}=N)")
    bad = [k for k, v in axes.items() if not isinstance(v, int) or v < 1]
    if bad:
        raise ConfigError(f"mesh {shown}: axis sizes must be whole numbers >= 1 ({', '.join(bad)})")
    if math.prod(axes.values()) != num_devices:
        raise ConfigError(f"mesh {shown} has {math.prod(axes.values())} places but there are {num_devices} devices: "
                          "make the product of the axis sizes equal the device count")

