"""How an epoch's steps are cut into compiled calls: up to ``steps_per_call`` steps in each.

A call of k steps is one program (``Trainer.steps``: a scan over the step,
the state donated): the host dispatches once and reads k steps' metrics
once. Hooks act between calls, so a call ends where one is due: at every
multiple of a cutting hook's period (a checkpoint, a step evaluation), at
a profile's start and stop, at the epoch's end and at
``max_steps``. Calls also end at multiples of ``steps_per_call`` counted
from the epoch's first batch, so a run resumed at any boundary makes the
same calls as the uninterrupted one, and without a cutting hook every epoch
makes the same calls (two programs: k steps and the remainder); a
checkpoint period that is not a multiple of k adds programs for the calls
it cuts short. A hook that does not cut (a stop request from a signal, the
step log) is read after each call: at most ``steps_per_call`` steps late.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np


def call_sizes(start: int, done: int, epoch_steps: int, max_steps: int | None, periods: Iterable[int],
               steps_per_call: int, points: Iterable[int] = ()) -> list[int]:
    """The sizes of the calls that run an epoch from its batch ``start`` on, ``done`` steps into the run; a call
    also ends after each step of ``points``."""
    left = epoch_steps - start if max_steps is None else min(epoch_steps - start, max_steps - done)
    periods, points = list(periods), list(points)
    sizes, batch, step = [], start, done
    while left > 0:
        size = min(left, steps_per_call - batch % steps_per_call, *(p - step % p for p in periods),
                   *(p - step for p in points if p > step))
        sizes.append(size)
        batch, step, left = batch + size, step + size, left - size
    return sizes


def stacked(batches: Iterable[dict], sizes: Iterable[int]) -> Iterator[tuple[int, dict]]:
    """``(k, batch)`` per call: the next host batch as it is where k is 1, else the next k stacked ``[k, ...]``
    (a short stream ends the calls where it ends)."""
    batches = iter(batches)
    for size in sizes:
        group = list(itertools.islice(batches, size))
        if len(group) < size:
            yield from ((1, batch) for batch in group)
            return
        yield size, group[0] if size == 1 else {key: np.stack([b[key] for b in group]) for key in group[0]}


def rows(metrics: dict, size: int) -> list[dict]:
    """A call's metrics (read, on the host) as one dict per step: ``[k]`` arrays split where k > 1."""
    if size == 1:
        return [metrics]
    return [{key: value[i] for key, value in metrics.items()} for i in range(size)]
