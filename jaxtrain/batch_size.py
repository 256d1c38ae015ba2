"""Batch-size finder from the compiled step's memory analysis: no trial-and-error OOMs.

The classic recipe doubles the batch until the GPU runs out of memory. Here
the train step is only COMPILED at growing batch sizes; XLA's memory
analysis says how many bytes each device needs (arguments + outputs + temps,
less what donation writes in place). A binary search finds the largest batch
within the budget, and a least-squares line memory = a + b * batch recovers
the lesson's rule "model memory + batch size x per-example memory".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxtrain.diagnostics import compiled_stats, step_bytes
from jaxtrain.errors import ConfigError
from jaxtrain.sharding import device_bytes

UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
         "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes (binary units for K/M/G)."""
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    try:
        return int(float(number) * UNITS[t[len(number):]])
    except (KeyError, ValueError):
        raise ConfigError(f"cannot read a memory size from {text!r}: write it like 2GiB, 512MiB or 1e9") from None


@dataclasses.dataclass
class BatchSizeResult:
    batch_size: int  # the largest global batch whose step fits the budget
    predicted_bytes: int  # per device, at batch_size
    budget_bytes: int
    next_batch_size: int  # the next candidate (batch_size + unit), which does not fit
    next_bytes: int
    table: list[tuple[int, int]]  # every (batch, bytes per device) compiled
    intercept_bytes: float  # a: "model memory" (params, optimizer state, fixed buffers)
    bytes_per_example: float  # b: per example of the GLOBAL batch, per device
    r2: float


def _fit(table):
    x = np.array([b for b, _ in table], float)
    y = np.array([m for _, m in table], float)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (intercept + slope * x)
    total = ((y - y.mean()) ** 2).sum()
    return intercept, slope, (1.0 - (residual**2).sum() / total) if total > 0 else 1.0


def device_budget(fraction: float = 0.9) -> int | None:
    """``fraction`` of the first device's memory limit, or None where it is not reported (CPU)."""
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    return int(limit * fraction) if limit else None


def find_batch_size(trainer, state, make_batch: Callable[[int], dict], budget_bytes: int | None = None,
                    max_batch: int = 2**16, progress: Callable[[int, int], None] | None = None) -> BatchSizeResult:
    """The largest global batch (a multiple of devices x micro-batches) that fits ``budget_bytes`` per device."""
    if budget_bytes is None:
        budget_bytes = device_budget()
        if budget_bytes is None:
            raise ConfigError(f"{jax.local_devices()[0].platform} devices report no memory limit: "
                              "pass budget_bytes=")
    unit = trainer.batches.unit
    measured: dict[int, int] = {}

    def need(batch: int) -> int:
        if batch not in measured:
            measured[batch] = step_bytes(compiled_stats(trainer, state, make_batch(batch), residuals=False))
            if progress is not None:
                progress(batch, measured[batch])
        return measured[batch]

    model_bytes = device_bytes(state)
    if budget_bytes < model_bytes or need(unit) > budget_bytes:
        raise ConfigError(f"a budget of {budget_bytes / 2**20:,.1f} MiB is smaller than the model itself: "
                          f"state {model_bytes / 2**20:,.1f} MiB per device, the step at the smallest batch ({unit}) needs "
                          f"{need(unit) / 2**20:,.1f} MiB per device; raise the budget or shrink the model")
    lo, hi = unit, 2 * unit  # lo fits; once the doubling stops, hi (a multiple of unit) does not
    while hi <= max_batch and need(hi) <= budget_bytes:
        lo, hi = hi, 2 * hi
    while hi - lo > unit:  # binary search on multiples of unit
        mid = (lo + hi) // 2 // unit * unit
        if need(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    nxt = lo + unit
    next_bytes = need(nxt) if nxt <= max_batch else -1
    table = sorted(measured.items())
    a, b, r2 = _fit(table) if len(table) > 1 else (float(table[0][1]), 0.0, 1.0)
    return BatchSizeResult(lo, measured[lo], budget_bytes, nxt, next_bytes, table, a, b, r2)
