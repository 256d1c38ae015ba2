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

from jaxtrain.analysis.diagnostics import compiled_stats, step_bytes
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel.sharding import device_bytes

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
                    max_batch: int = 2**16, progress: Callable[[int, int], None] | None = None,
                    start: int | None = None, known: dict[int, int] | None = None,
                    tolerance: float = 0.0, measure: Callable[[int], int] | None = None) -> BatchSizeResult:
    """The largest global batch (a multiple of devices x micro-batches) that fits ``budget_bytes`` per device.

    ``start``: a batch to aim from: the line through the smallest batch and ``start`` predicts where the
    budget runs out, and the search brackets that guess (a few compiles, where doubling from the smallest batch
    takes ~2 log2(answer)); ``known``: bytes per device already measured, ``{batch: bytes}``; ``tolerance``: stop
    once the bracket is this fraction of the answer (0: exact; XLA's memory is not monotonic in the batch near
    a device's limit, where its rematerialisation squeezes, so an exact answer there costs many compiles);
    ``measure(batch) -> bytes per device``: how a batch is measured (default: ``compiled_stats``)."""
    if budget_bytes is None:
        budget_bytes = device_budget()
        if budget_bytes is None:
            raise ConfigError(f"{jax.local_devices()[0].platform} devices report no memory limit: "
                              f"pass {named('budget_bytes')}")
    unit = trainer.batch_plan.unit
    measured: dict[int, int] = dict(known or {})

    def need(batch: int) -> int:
        if batch not in measured:
            measured[batch] = (measure(batch) if measure else
                               step_bytes(compiled_stats(trainer, state, make_batch(batch), residuals=False)))
            if progress is not None:
                progress(batch, measured[batch])
        return measured[batch]

    def check_smallest() -> None:
        model_bytes = device_bytes(state)
        if budget_bytes < model_bytes or need(unit) > budget_bytes:
            raise ConfigError(f"a budget of {budget_bytes / 2**20:,.1f} MiB is smaller than the model itself: state "
                              f"{model_bytes / 2**20:,.1f} MiB per device, the step at the smallest batch ({unit}) "
                              f"needs {need(unit) / 2**20:,.1f} MiB per device; raise the budget or shrink the model")

    lo, hi = unit, 2 * unit  # lo fits; once the search stops growing, hi (a multiple of unit) does not
    start = None if start is None else min(start // unit * unit, max_batch)
    if start is None or start <= unit or need(start) > budget_bytes:
        check_smallest()
        if start is not None and start > unit:
            lo, hi = unit, start
    else:  # a line through start and 16 x start (the bytes of small batches are mostly fixed ones)
        far = min(16 * start, max_batch)
        if far > start and need(far) > budget_bytes:
            lo, hi = start, far
        else:
            slope = (need(far) - need(start)) / (far - start) if far > start else 0
            guess = far + (budget_bytes - need(far)) / slope if slope > 0 else max_batch
            guess = max(far, min(int(guess) // unit * unit, max_batch))
            step = max(unit, int(tolerance * guess) // unit * unit)
            lo, hi = (guess, guess + step) if need(guess) <= budget_bytes else (far, guess)
    while hi <= max_batch and need(hi) <= budget_bytes:
        lo, hi = hi, 2 * hi

    def between(lo: int, hi: int) -> int:
        """Where the line through lo and hi meets the budget (kept off both ends), or halfway if hi is unmeasured."""
        x = (lo + hi) / 2
        if hi in measured and measured[hi] > measured[lo]:
            x = lo + (budget_bytes - measured[lo]) * (hi - lo) / (measured[hi] - measured[lo])
            x = min(max(x, lo + (hi - lo) / 8), hi - (hi - lo) / 8)
        return max(lo + unit, min(hi - unit, int(x) // unit * unit))

    while hi - lo > max(unit, tolerance * lo):  # a bracket on multiples of unit: lo fits, hi does not
        mid = between(lo, hi)
        if need(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    nxt = lo + unit if tolerance == 0 or hi > max_batch else hi
    next_bytes = need(nxt) if nxt <= max_batch else -1
    table = sorted(measured.items())
    a, b, r2 = _fit(table) if len(table) > 1 else (float(table[0][1]), 0.0, 1.0)
    return BatchSizeResult(lo, measured[lo], budget_bytes, nxt, next_bytes, table, a, b, r2)
