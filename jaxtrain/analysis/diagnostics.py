"""What a compiled step costs, read without running it: FLOPs, bytes, residuals."""

from __future__ import annotations

import time
from collections.abc import Mapping

import jax
import numpy as np

from jaxtrain.analysis.peaks import peak_flops
from jaxtrain.analysis.traffic import (  # noqa: F401 (their home)
    COLLECTIVES, collective_bytes, collective_op, crossing_bytes, replica_hosts)
from jaxtrain.core import compat, step
from jaxtrain.errors import named


def _first(analysis):
    """cost_analysis() is a dict in current JAX, a list of dicts in older ones."""
    if isinstance(analysis, (list, tuple)):
        return analysis[0] if analysis else {}
    return analysis or {}


def program_flops(compiled) -> float:
    """XLA's FLOPs of a compiled program, plus its oneDNN convolutions' (XLA counts nothing in a custom call),
    plus the matmuls and convolutions of a while loop's later trips (XLA's cost analysis counts a loop's body
    once: a scan over a GPT's or a ViT's blocks, the micro-batches of ``accum="scan"``)."""
    from jaxtrain.analysis import hlo
    from jaxtrain.kernels import onednn

    counted = float(_first(compiled.cost_analysis()).get("flops", float("nan")))
    text = compiled.as_text()
    extra = onednn.hlo_flops(text) + hlo.matmul_flops(text) - hlo.matmul_flops(text, trips=False)
    return max(counted, 0.0) + extra if extra else counted


def saved_residual_bytes(trainer, state, batch: Mapping) -> int:
    """Bytes of activations one device saves for the backward pass.

    The residuals ``jax.ad_checkpoint.print_saved_residuals`` lists for the
    loss of one device's (micro-)batch, minus the function's own arguments
    (params and inputs exist anyway). This is what a remat policy controls,
    whatever the backend's scheduler then does with the memory.
    """
    per_call = trainer.batch_plan.data_shards * trainer.scan_steps  # the rows one micro-batch of one shard sees
    local = {k: jax.ShapeDtypeStruct((v.shape[0] // per_call, *v.shape[1:]), v.dtype) for k, v in batch.items()}
    cast = step.cast_loss(trainer.loss_fn, trainer.policy)  # what the step differentiates

    def loss(params, micro):
        return cast(params, state.model_state, jax.lax.stop_gradient(micro), jax.random.key(0))[0]

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
    total = 0
    for aval, source in compat.saved_residuals(loss, params, local):
        if not source.startswith("from the argument"):
            total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return total


def compiled_stats(trainer, state, batch: Mapping, residuals: bool = True) -> dict:
    """FLOPs, bytes and memory of the compiled train step, without running it.

    All figures are PER DEVICE (XLA compiles one program per device): the
    step's total FLOPs are ``flops * devices``. ``flops`` and
    ``bytes_accessed`` come from XLA's ``cost_analysis``; ``temp_bytes``,
    ``argument_bytes``, ``output_bytes`` and ``alias_bytes`` (outputs written
    into donated inputs) from ``memory_analysis``; ``saved_residual_bytes``
    from ``saved_residual_bytes`` (skipped with ``residuals=False``);
    ``collectives`` from the compiled HLO (``collective_bytes``).
    """
    compiled = trainer.lower(state, batch).compile()
    cost = _first(compiled.cost_analysis())
    mem = compiled.memory_analysis()
    return {
        "flops": program_flops(compiled),
        "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
        "argument_bytes": int(getattr(mem, "argument_size_in_bytes", -1)),
        "output_bytes": int(getattr(mem, "output_size_in_bytes", -1)),
        "alias_bytes": int(getattr(mem, "alias_size_in_bytes", -1)),
        "saved_residual_bytes": saved_residual_bytes(trainer, state, batch) if residuals else None,
        "collectives": collective_bytes(compiled.as_text()),
        "devices": trainer.num_devices,
    }


def step_bytes(stats: dict) -> int:
    """Device memory one compiled step needs: arguments + outputs + temps, less donated (aliased) outputs."""
    return stats["argument_bytes"] + stats["output_bytes"] + stats["temp_bytes"] - max(stats["alias_bytes"], 0)


# ------------------------------------------------------------ memory report


def _host_memory() -> tuple[int, int] | None:
    """(used, total) bytes of host RAM, from /proc/meminfo (None where unavailable)."""
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        total = int(info["MemTotal"].split()[0]) * 1024
        available = int(info["MemAvailable"].split()[0]) * 1024
        return total - available, total
    except (OSError, KeyError, ValueError):
        return None


def host_memory_warning(stats: dict, devices) -> str | None:
    """On CPU every device's buffers live in host RAM, and a step that needs more than is free gets the process
    killed (exit 137) with no message: a warning to log before the first step, when one step's temps and
    outputs on this process's devices exceed 90% of the available memory (the state and the batch are already
    resident); None when it fits."""
    host = _host_memory()
    if not devices or devices[0].platform != "cpu" or host is None:
        return None
    local = [d for d in devices if d.process_index == jax.process_index()]
    per_device = stats["temp_bytes"] + stats["output_bytes"] - max(stats["alias_bytes"], 0)
    available = host[1] - host[0]
    if per_device * len(local) <= 0.9 * available:
        return None
    return (f"one step needs ~{per_device * len(local) / 2**30:.1f} GiB more host memory ({len(local)} "
               f"devices x {per_device / 2**30:.2f} GiB) and {available / 2**30:.1f} GiB is available: the run may be "
               f"killed; use a smaller {named('batch_size')} (or fewer {named('devices')})")


NOT_REPORTED = "not reported"


def memory_report(devices=None) -> dict:
    """Host memory and, per local device, bytes in use / peak / limit (or "not reported").

    GPUs report ``memory_stats()``; XLA:CPU reports nothing, which is said
    plainly rather than shown as zeros.
    """
    host = _host_memory()
    report = {"host": {"used_bytes": host[0], "total_bytes": host[1]} if host else NOT_REPORTED, "devices": []}
    for d in devices if devices is not None else jax.local_devices():
        stats = d.memory_stats() or {}
        report["devices"].append({
            "device": str(d),
            "bytes_in_use": stats.get("bytes_in_use", NOT_REPORTED),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use", NOT_REPORTED),
            "bytes_limit": stats.get("bytes_limit", NOT_REPORTED),
        })
    return report


def format_memory_report(report: dict) -> str:
    def mb(v):
        return f"{v / 2**20:,.0f} MiB" if isinstance(v, int) else v

    host = report["host"]
    lines = [f"host: {mb(host['used_bytes'])} used of {mb(host['total_bytes'])}" if isinstance(host, dict)
             else f"host: {host}"]
    for d in report["devices"]:
        lines.append(f"{d['device']}: in use {mb(d['bytes_in_use'])}, peak {mb(d['peak_bytes_in_use'])}, "
                     f"limit {mb(d['bytes_limit'])}")
    return "\n".join(lines)


# ------------------------------------------------------------ model summary


def summarize(params, apply_fn=None, example_batch=None) -> dict:
    """Parameters per layer and in total, their bytes in fp32/bf16, FLOPs per example.

    Layers are the params' paths less the last key (``conv1/w`` and
    ``conv1/b`` make ``conv1``). FLOPs per example come from XLA's cost
    analysis of the compiled ``apply_fn(params, example_batch)`` divided by
    the batch size.
    """
    layers: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        name = "/".join(str(k) for k in keys[:-1]) or str(keys[0])
        layers[name] = layers.get(name, 0) + int(np.prod(np.shape(leaf)))
    total = sum(layers.values())
    out = {"layers": layers, "total_params": total, "bytes_fp32": 4 * total, "bytes_bf16": 2 * total,
           "flops_per_example": None}
    if apply_fn is not None and example_batch is not None:
        batch = len(jax.tree.leaves(example_batch)[0])
        out["flops_per_example"] = program_flops(jax.jit(apply_fn).lower(params, example_batch).compile()) / batch
    return out


def format_summary(summary: dict) -> str:
    width = max(len(n) for n in summary["layers"]) + 2
    lines = [f"{'layer':<{width}}{'params':>12}"]
    lines += [f"{name:<{width}}{count:>12,}" for name, count in summary["layers"].items()]
    lines.append(f"{'total':<{width}}{summary['total_params']:>12,}  "
                 f"({summary['bytes_fp32'] / 2**20:.2f} MiB fp32, {summary['bytes_bf16'] / 2**20:.2f} MiB bf16)")
    if summary["flops_per_example"] is not None:
        lines.append(f"forward FLOPs per example: {summary['flops_per_example'] / 1e6:,.2f} M")
    return "\n".join(lines)


# ------------------------------------------------------------ throughput and MFU

def devices_peak(devices, precision: str, measure: bool = False) -> float | None:
    """The dense peak FLOP/s of ``devices`` together, for the MFU: GPUs' datasheet peaks for the precision
    (``jaxtrain.analysis.peaks``) add up; ``measure``: a measured fp32 matmul peak instead (per GPU; virtual CPU
    devices share the cores one measured matmul uses, so theirs is the host's). None where neither is known."""
    gpus = devices[0].platform == "gpu"
    one = measure_matmul_peak() if measure else peak_flops(devices[0].device_kind, precision) if gpus else None
    return one * len(devices) if one and gpus else one


def measure_matmul_peak(n: int = 2048, repeats: int = 5, device=None) -> float:
    """FLOP/s of an n x n fp32 matmul on one device (best of ``repeats``): a measured peak."""
    device = device or jax.local_devices()[0]
    a = jax.device_put(np.random.default_rng(0).random((n, n), np.float32), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best
