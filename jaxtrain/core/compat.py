"""What differs between the JAX versions jaxtrain supports, in one place.

Tested: jax/jaxlib 0.10.2 (Python 3.11) and 0.12.0.1 (Python 3.12, 3.13);
docs/getting-started.md, "Tested versions". Every branch below says which version needs it.
Nothing here imports jax at module level: ``cpu_xla_flags`` must be answered
before JAX starts (XLA reads $XLA_FLAGS once, when its first backend starts).
"""

from __future__ import annotations

import re
from importlib import metadata

# XLA:CPU flags jaxtrain sets (devices.setup_devices), each with the jaxlib
# versions it is known to exist in ([first, last] tested) and the CPUs (vector
# ISA, ``cpu_isa``) where it measured a win. An UNKNOWN flag in $XLA_FLAGS
# aborts the process at start-up, so a flag is never set for a jaxlib outside
# its tested range; a CPU it was not measured on keeps XLA's defaults.
#
# --xla_cpu_experimental_ynn_fusion_type=reduce: jaxlib 0.10.2, 0.11.2 and
# 0.12.0.1 all hand convolutions and dots to YNNPACK fusions by default,
# which ran LeNet's step slower than XLA's own Eigen kernels
# (docs/performance.md, "Per CPU": experiments.bench with and without
# --xla-defaults, torch/jaxtrain paired): AVX-512 1.04 vs 0.93 (0.10.2) and
# 1.01 vs 0.93 (0.12); AVX2 1.01 vs 0.89 (0.12), and within the noise on 0.10.2
# (1.07 and 1.01 vs 1.02), kept there for one behaviour per CPU kind.
# Reductions stay with YNNPACK (XLA's own lost accuracy in BatchNorm statistics).
CPU_XLA_FLAGS = (
    ("--xla_cpu_experimental_ynn_fusion_type=reduce", (0, 10, 2), (0, 12, 0), ("AVX-512", "AVX2")),
)


# XLA:GPU's command buffers (CUDA graphs: kernels recorded once, then launched by the host as one), by
# JAXTRAIN_COMMAND_BUFFERS; devices.setup_devices adds the flag where the platform is a GPU.
# - "xla": nothing set, XLA's own choice. jaxlib 0.12.0.1 records fusions, cuBLAS and cuDNN calls, custom calls,
#   dynamic-slice fusions, collective kernels and conditionals; a while loop stays on the host, which launches its
#   body's thunks at every trip.
# - "off": no command buffers at all.
# - "loops": XLA's own choice plus loops and conditionals (WHILE, CONDITIONAL; 0.12.0.1 lacks only WHILE): a loop
#   whose every thunk can be recorded becomes part of one command buffer. A loop holding one that cannot (a
#   convolution thunk, an async copy on another stream) stays on the host: experiments.command_buffers shows which,
#   compiled for a GPU here; tests/test_gpu_compile.py holds these claims to jaxlib 0.12.0.1.
# Collectives are left as XLA sets them (inside command buffers they have hung in other projects). The flag's two
# forms ("" and "+TYPE,...") parse in jaxlib 0.10.2, 0.11.2 and 0.12.0.1; a jaxlib outside that range gets no flag
# (an unknown form aborts the process at start-up). Which mode is faster is measured by `make gpu-check`'s buffers
# part; until a GPU has measured it, the default sets nothing.
COMMAND_BUFFER_FLAGS = {"xla": (), "off": ("--xla_gpu_enable_command_buffer=",),
                        "loops": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",)}
COMMAND_BUFFER_JAXLIB = ((0, 10, 2), (0, 12, 0))  # set for these (and those between)
COMMAND_BUFFER_TESTED = "jaxlib 0.10.2, 0.11.2 and 0.12.0.1"  # where the forms were seen to parse


def gpu_xla_flags(command_buffers: str, jaxlib: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """The GPU flags for JAXTRAIN_COMMAND_BUFFERS=``command_buffers`` under ``jaxlib`` (default: the installed
    one): () where it sets nothing, or the jaxlib is outside the tested range (``command_buffers_untested``)."""
    jaxlib = installed_version("jaxlib") if jaxlib is None else jaxlib
    first, last = COMMAND_BUFFER_JAXLIB
    return COMMAND_BUFFER_FLAGS[command_buffers] if jaxlib is not None and first <= jaxlib[:3] <= last else ()


def command_buffers_untested(command_buffers: str, jaxlib: tuple[int, ...] | None = None) -> bool:
    """A mode that sets a flag, under a jaxlib where its forms are not known to parse (the flag is left out)."""
    return bool(COMMAND_BUFFER_FLAGS[command_buffers]) and not gpu_xla_flags(command_buffers, jaxlib)


def command_buffers_said(xla_flags: str) -> str:
    """What ``xla_flags`` leave XLA:GPU's command buffers, read as XLA reads its flag, in order: a list replaces
    the types ("off" where empty), "+TYPE" and "-TYPE" change those so far. "XLA's own" where none is given,
    "XLA's own + WHILE, CONDITIONAL" where only changes are."""
    base, plus, minus = None, [], []  # base None: XLA's own types
    for value in re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", xla_flags):
        items = [v for v in value.split(",") if v]
        if items and all(v[0] in "+-" for v in items):
            for v in items:
                name = v[1:].upper()
                if base is not None:
                    base = [b for b in base if b != name] + ([name] if v[0] == "+" else [])
                else:
                    plus, minus = ([p for p in plus if p != name], [m for m in minus if m != name])
                    (plus if v[0] == "+" else minus).append(name)
        else:
            base, plus, minus = [v.upper() for v in items], [], []
    if base is not None:
        return ", ".join(base) or "off"
    return "XLA's own" + "".join(f" {sign} {', '.join(names)}" for sign, names in (("+", plus), ("-", minus))
                                  if names)


# The int8 inference programs (jaxtrain.analysis.quantize) are compiled with their own options, per jit: convolutions
# and dots to YNNPACK, which has int8 kernels. Under the training flag above they go to Eigen, which has none:
# XLA widens int8 operands to int32 there, and LeNet's int8 conv2 ran ~9x slower than in fp32
# (experiments.bench_int8). The list form of the option is parsed by jaxlib 0.10.2 and 0.12.0.1 alike.
INT8_CPU_OPTIONS = (({"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                     "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION,LIBRARY_FUSION_TYPE_REDUCE"}, (0, 10, 2), (0, 12, 0)),)


def version_tuple(text: str) -> tuple[int, ...]:
    """ "0.12.0.1" -> (0, 12, 0): the release's first three numbers (local parts ignored)."""
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def installed_version(dist: str) -> tuple[int, ...] | None:
    """The installed distribution's version, read without importing it (None if absent)."""
    text = installed_version_text(dist)
    return None if text is None else version_tuple(text)


def installed_version_text(dist: str) -> str | None:
    """The installed distribution's whole version string ("0.12.0.1"), read without importing it (None if
    absent)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_xla_flags(jaxlib: tuple[int, ...] | None = None, isa: str | None = None) -> tuple[str, ...]:
    """The CPU flags jaxtrain sets for ``jaxlib`` on a CPU of vector ISA ``isa`` (defaults: the installed jaxlib,
    this CPU's ``cpu_isa()``)."""
    jaxlib = installed_version("jaxlib") if jaxlib is None else jaxlib
    isa = cpu_isa() if isa is None else isa
    if jaxlib is None:
        return ()
    return tuple(flag for flag, first, last, isas in CPU_XLA_FLAGS if first <= jaxlib[:3] <= last and isa in isas)


# XLA's --xla_cpu_max_isa values on x86, by the level cpu_isa names (an x86 host's code is built for the lower
# of its own ISA and this cap).
_ISA_LEVELS = {"SSE4_2": 1, "AVX": 1, "AVX2": 2, "AVX512": 3, "AVX512_VNNI": 3, "AVX512_BF16": 3, "AMX": 3}


def cpu_isa(cpuinfo: str | None = None, xla_flags: str | None = None) -> str:
    """The vector ISA XLA:CPU builds code for here: "AVX-512", "AVX2", "older than AVX2" (x86; read from
    /proc/cpuinfo's flags, capped by ``--xla_cpu_max_isa`` in $XLA_FLAGS), or "" where that cannot be read (not
    Linux on x86). CPUs differ between machines: results and benchmarks name it, and CPU flags follow it."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ""
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    if not flags & {"sse4_2", "avx", "avx2", "avx512f"}:
        return ""
    level = 3 if "avx512f" in flags else 2 if "avx2" in flags else 1
    if xla_flags is None:
        from jaxtrain.settings import xla_flags as given

        xla_flags = given()
    cap = re.search(r"--xla_cpu_max_isa=(\w+)", xla_flags)
    if cap:
        level = min(level, _ISA_LEVELS.get(cap.group(1).upper(), level))
    return {3: "AVX-512", 2: "AVX2", 1: "older than AVX2"}[level]


def int8_compiler_options(jaxlib: tuple[int, ...] | None = None) -> dict:
    """``jax.jit(..., compiler_options=)`` for int8 inference programs on ``jaxlib`` (default: the installed
    one): {} outside the tested range (XLA's defaults then, which also send int8 to YNNPACK)."""
    jaxlib = installed_version("jaxlib") if jaxlib is None else jaxlib
    if jaxlib is None:
        return {}
    return next((dict(options) for options, first, last in INT8_CPU_OPTIONS if first <= jaxlib[:3] <= last), {})


def backend_started() -> bool:
    """Has JAX started a backend (so device counts and XLA flags are fixed)?"""
    # No public API answers this in jax 0.10.2 ... 0.12.0.1.
    from jax._src import xla_bridge  # public API missing: "has a backend started?"

    return xla_bridge.backends_are_initialized()


def saved_residuals(fn, *args):
    """[(aval, source)] of what ``fn``'s VJP saves: what ``jax.ad_checkpoint.print_saved_residuals`` prints."""
    # The list itself has no public API in jax 0.10.2 ... 0.12.0.1 (only the printer).
    from jax._src.ad_checkpoint import saved_residuals as listing  # public: only the printer

    return listing(fn, *args)


def offloadable(src: str, dst: str):
    """A remat policy's answer "save this value, in ``dst`` memory" (jax.checkpoint_policies' own offload
    policies return it; it has no public name in jax 0.10.2 ... 0.12.0.1)."""
    from jax._src.interpreters.partial_eval import Offloadable  # no public name for it (jax 0.10.2 ... 0.12.0.1)

    return Offloadable(src=src, dst=dst)


# Lowering a Pallas kernel for CUDA on a host without a GPU (tests, docs/kernels.md): the Triton lowering needs
# the target GPU's compute capability. jax 0.10.2 falls back to sm_90 when it finds no GPU; jax 0.12 asks for
# an abstract GPU device in the context mesh instead, which cannot hold a step whose mesh is of CPU devices,
# so there a whole train step does not lower for CUDA on a CPU host (the kernel and its gradient alone do).
TRITON_FALLBACK_WITHOUT_GPU = (0, 10, 2) <= (installed_version("jax") or (0,)) < (0, 11, 0)
CUDA_TARGET = "NVIDIA H100"  # sm_90, what jax 0.10.2 falls back to


# The kernels' Mosaic GPU versions (jaxtrain.kernels.mosaic) use plgpu.kernel, emit_pipeline with a carry and
# the WGMMA layouts' row reductions as jax 0.12 has them; tested there (lowered and compiled for H100; interpret
# mode on CPU). Older jax keeps Triton on every GPU.
MOSAIC_GPU_KERNELS = (installed_version("jax") or (0,)) >= (0, 12, 0)


def cuda_kernel_target():
    """A context in which a Pallas Triton kernel (not a CPU-mesh step) lowers for CUDA on a host without a GPU."""
    import contextlib

    import jax

    if TRITON_FALLBACK_WITHOUT_GPU:
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=CUDA_TARGET, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device))


def varying_axes(x) -> frozenset:
    """The manual (``shard_map``) axes ``x`` is typed as varying over (jax 0.10: ``.manual_axis_type.varying``;
    later: ``.vma``); empty outside ``shard_map`` and where it runs unchecked."""
    import jax

    t = jax.typeof(x)
    return frozenset(getattr(t, "vma", None) or getattr(getattr(t, "manual_axis_type", None), "varying", ()))
