"""GPU targets from the vendors' published specifications (``analysis/targets.json``), and meshes of
compile-only GPUs.

XLA:GPU compiles ahead of time with no GPU and no driver: JAX's CUDA plugin describes a topology of
compile-only devices from a target config (the GPU's SM count, clocks, memory, compute capability), and
``jax.jit(...).lower(shapes).compile()`` then gives the real per-GPU program. The plugin must register
before any JAX backend starts, with ``JAX_PLATFORMS=cpu`` (so that it does not look for a GPU):
``mesh_for`` sets that itself where it still can, and says what to do where it cannot.
"""

from __future__ import annotations

import dataclasses
import functools
from importlib.util import find_spec

import numpy as np

from jaxtrain.analysis.peaks import board, dense_peak, specs
from jaxtrain.choices import MESH_AXES
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel.devices import DATA_AXIS, REPLICA_AXIS

# What the GPU leg was tested with (README "Planning for GPUs"): the topology API is experimental.
TESTED = "jax[cuda12]==0.12.0.1"
INSTALL = ("pip install 'jaxtrain[gpu-compile]' (in the checkout: pip install -e '.[gpu-compile]'; Python >= "
           "3.12: it installs jax[cuda12] 0.12.0.1, ~3.4 GB of NVIDIA wheels; no GPU or driver needed)")
PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU model (``targets.json``): compute capability, SMs, clock, memory and bandwidths, dense peaks."""

    key: str
    name: str
    device_kind: str
    compute_capability: tuple[int, int]
    sms: int
    fp32_cores_per_sm: int
    clock_ghz: float
    memory_gb: float
    memory_bandwidth_gbps: float
    l2_cache_mib: float
    shared_memory_per_sm_kib: int
    shared_memory_per_block_kib: int
    nvlink_gbps: float
    network_gbps_per_gpu: float
    gpus_per_host: int
    host_link_gbps: float  # to the host's (pinned) memory, per direction: PCIe
    peak_tflops: dict
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def peak_flops(self, precision: str) -> float:
        return dense_peak(self.peak_tflops, precision)

    def config_text(self) -> str:
        """The target as XLA's ``GpuTargetConfigProto`` in text form (what the CUDA plugin compiles for)."""
        major, minor = self.compute_capability
        info = {
            "threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": self.shared_memory_per_sm_kib * 1024, "threads_per_core_limit": 2048,
            "core_count": self.sms, "fpus_per_core": self.fp32_cores_per_sm, "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.memory_bandwidth_gbps * 1e9), "l2_cache_size": int(self.l2_cache_mib * 2**20),
            "clock_rate_ghz": self.clock_ghz, "device_memory_size": self.memory_bytes,
            "shared_memory_per_block_optin": self.shared_memory_per_block_kib * 1024,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
        }
        lines = [f"  {k}: {v}" for k, v in info.items()]
        lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
        return ("gpu_device_info {\n" + "\n".join(lines) + "\n}\n"
                f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 7 }}\n'
                f'device_description_str: "{self.device_kind}"\n')


@dataclasses.dataclass(frozen=True)
class Costs:
    """The estimate's constants that are not one GPU's (``targets.json`` "_costs", with their sources): the
    share of its roofline a kernel reaches (fitted), the launch cost of a kernel, and NCCL's cost model
    (``protocols``: per algorithm, ``"ring"`` and ``"tree"``, and protocol, ``"LL"`` and ``"Simple"``: base
    latency, latency per NVLink and per network step, bandwidth share; the tree's bus share and caps)."""

    efficiency: float
    efficiency_source: str
    launch_us: float
    launch_source: str
    protocols: dict
    protocols_source: str


def costs() -> Costs:
    return Costs(**specs()["_costs"])


@functools.cache
def _table() -> dict:
    data = specs()
    return {key: Target(key=key, **{**spec, "compute_capability": tuple(spec["compute_capability"])})
            for key, spec in data.items() if not key.startswith("_")}


def for_device(device_kind: str) -> Target | None:
    """The target of the real GPU JAX names ``device_kind`` ("NVIDIA H100 80GB HBM3" -> h100); None for a board
    known only by its peaks (an H100 PCIe is not the SXM target) or for another device (a CPU)."""
    return _table().get(board(device_kind))


def names() -> tuple[str, ...]:
    """The GPU targets there are, by key."""
    return tuple(sorted(_table()))


def target(name: str | Target) -> Target:
    """``"h100"``, ``"h200"``, ``"a100"``, ``"b200"`` or ``"v100"``; ConfigError for another name."""
    if isinstance(name, Target):
        return name
    table = _table()
    if str(name).lower() not in table:
        raise ConfigError(f"unknown GPU {name!r}: choose one of {', '.join(names())}")
    return table[str(name).lower()]


def check_plugin() -> None:
    """A ConfigError naming the install unless JAX's CUDA plugin is installed."""
    if not any(find_spec(p) for p in PLUGINS):
        raise ConfigError(f"compiling for GPUs needs JAX's CUDA plugin, which is not installed: {INSTALL}")


def _backends_started() -> bool:
    from jax._src import xla_bridge  # no public API says whether a backend has started (jax 0.10.2 ... 0.12)

    return xla_bridge.backends_are_initialized()


@functools.cache
def _topology(key: str, hosts: int, gpus: int):
    import jax
    from jax.experimental import topologies

    t = target(key)
    if not _backends_started() and jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")  # the plugin then registers without looking for a GPU
    try:
        return topologies.get_topology_desc(platform="cuda", target_config=t.config_text(),
                                            topology=f"1x{hosts}x{gpus}")
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError / XlaRuntimeError / ValueError here
        if _backends_started() and jax.config.jax_platforms != "cpu":
            raise ConfigError("a JAX backend started in this process before jaxtrain.gpu could set "
                              "JAX_PLATFORMS=cpu, so the CUDA plugin is not registered: run in a fresh process, "
                              "or set JAX_PLATFORMS=cpu before JAX starts") from None
        raise ConfigError(f"XLA could not describe {hosts} x {gpus} {t.name}: {str(e).splitlines()[0][:200]} "
                          f"(tested with {TESTED})") from None


def mesh_for(gpu: str | Target = "h100", gpus: int = 8, hosts: int = 1, axes: dict[str, int] | None = None):
    """A ``Mesh`` of compile-only devices: ``hosts`` nodes of ``gpus`` GPUs each, axes ``{"data": N}`` by
    default (``{"data": 2, "model": 4}``, ``{"data": 2, "stage": 4}``: product = gpus x hosts). Steps built
    on it compile for that GPU (``trainer.abstract_state`` / ``trainer.lower(...).compile()``); they cannot
    run. ConfigError for an unknown GPU, more GPUs than a node has, axes that do not fit, no plugin."""
    from jax.sharding import Mesh

    t = target(gpu)
    if gpus < 1 or hosts < 1:
        raise ConfigError(f"{named('gpus', gpus)}, {named('hosts', hosts)}: both must be >= 1")
    if gpus > t.gpus_per_host:
        raise ConfigError(f"{named('gpus', gpus)}: one {t.name} node holds at most {t.gpus_per_host}: use "
                          f"{named('hosts')} for more (e.g. {named('gpus', t.gpus_per_host)}, "
                          f"{named('hosts', -(-gpus // t.gpus_per_host))})")
    total = gpus * hosts
    axes = dict(axes or {DATA_AXIS: total})
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown or DATA_AXIS not in axes or int(np.prod(list(axes.values()))) != total:
        raise ConfigError(f"mesh axes {axes}: need a {DATA_AXIS!r} axis, names among {', '.join(MESH_AXES)}, and "
                          f"sizes whose product is gpus x hosts = {total}")
    if REPLICA_AXIS in axes and axes[REPLICA_AXIS] != hosts:
        raise ConfigError(f"mesh axes {axes}: {REPLICA_AXIS}= is the axis across hosts: make it "
                          f"{named('hosts', hosts)}")
    if REPLICA_AXIS in axes:  # the outer axis: one replica per host
        axes = {REPLICA_AXIS: axes.pop(REPLICA_AXIS), **axes}
    check_plugin()
    devices = _topology(t.key, hosts, gpus).devices
    return Mesh(np.asarray(devices).reshape(tuple(axes.values())), tuple(axes))
