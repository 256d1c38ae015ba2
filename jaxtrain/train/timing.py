"""Where the time goes: read results one step late, one clock per epoch, and the benchmarks' timers.

``OneStepLate``: the outputs of step k are read (which waits for step k)
only after step k+1 was dispatched, so at most 2 steps are in flight: the
device stays busy while the host prepares the next batch, and XLA:CPU's
all-reduce rendezvous deadlock with many steps queued on virtual devices is
avoided (2 CPU devices on 2 cores: ~50 LeNet steps dispatched without waiting hung
there; at most 2 in flight ran 100 cleanly). ``fit``, ``evaluate`` and the
benchmarks all use it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import jax


class OneStepLate:
    """``previous = late.push(outputs, *context)``: hold this step's outputs, return the previous step's, read.

    Returns ``None`` for the first push; ``flush()`` returns (and forgets) the
    last one. Read means ``jax.device_get``: host numbers, the step finished.
    """

    def __init__(self):
        self._held = None

    def push(self, outputs, *context):
        previous, self._held = self._held, (outputs, context)
        return self._read(previous)

    def flush(self):
        previous, self._held = self._held, None
        return self._read(previous)

    @property
    def pending(self) -> bool:
        return self._held is not None

    @staticmethod
    def _read(held):
        return None if held is None else (jax.device_get(held[0]), *held[1])


# JAX's own events for a program's tracing, lowering and compiling (or reading from the compilation cache): timed
# where they happen, synchronously in the thread that calls the program first.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compiled = {"sec": 0.0, "listening": False}


def compile_seconds() -> float:
    """Seconds this process spent tracing, lowering and compiling JAX programs so far (``COMPILE_EVENTS``, counted
    from the first call of this function)."""
    if not _compiled["listening"]:
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _compiled["listening"] = True
    return _compiled["sec"]


def _count_compile(event: str, duration: float, **_) -> None:
    if event in COMPILE_EVENTS:
        _compiled["sec"] += duration


class Chrono:
    """One epoch's clock: train time (wall time less the pauses), data wait, and the pauses by name.

    ``with chrono.waiting():`` around fetching a batch, ``with chrono.paused("checkpoint"):``
    around work that is not training (saving, evaluating). ``starts()`` is
    the loader's count of the times it started its pipeline (``Loader.starts``:
    worker processes starting, seconds even on a loader that keeps pace): a
    wait during which it moved is the loader's start-up, ``start_up``, left
    out of ``wait`` and of ``wait_fraction``. A loader that carries its
    workers on into the next epoch has no start-up there: that epoch's first
    wait is a wait like the others. ``prior`` carries the numbers of a
    resumed epoch's first part.
    """

    def __init__(self, prior: dict | None = None, starts: Callable[[], int] = lambda: 0):
        prior = prior or {}
        self._start = time.perf_counter()
        self._base = prior.get("train_sec", 0.0)
        self.wait = prior.get("wait", 0.0)
        self.start_up = prior.get("start_up", 0.0)
        self.pauses: dict[str, float] = dict(prior.get("pauses", {}))
        self._paused = 0.0  # pause time since _start
        self._starts, self._seen = starts, starts()  # the loader's starts, and their count the last wait saw

    @property
    def train_sec(self) -> float:
        return self._base + time.perf_counter() - self._start - self._paused

    @property
    def wait_fraction(self) -> float:
        """The share of the train time (its start-up left out) spent waiting for batches."""
        return self.wait / max(self.train_sec - self.start_up, 1e-9)

    @contextlib.contextmanager
    def waiting(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt, seen = time.perf_counter() - t0, self._starts()
            if seen != self._seen:  # the loader started while this wait lasted (or, ahead in a thread, before it)
                self.start_up += dt
                self._seen = seen
            else:
                self.wait += dt

    @contextlib.contextmanager
    def paused(self, what: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self._paused += dt
            self.pauses[what] = self.pauses.get(what, 0.0) + dt

    @contextlib.contextmanager
    def compiling(self):
        """Around making a call (the first of a program compiles it): JAX's compile time inside is a pause
        ("compile"); what runs or waits meanwhile (the previous call, a read) stays train time."""
        before = compile_seconds()
        try:
            yield
        finally:
            if dt := compile_seconds() - before:
                self._paused += dt
                self.pauses["compile"] = self.pauses.get("compile", 0.0) + dt

    def state(self) -> dict:
        """What a checkpoint keeps to resume this clock."""
        return {"train_sec": self.train_sec, "wait": self.wait, "start_up": self.start_up, "pauses": dict(self.pauses)}


def time_steps(step, state, batch, steps: int):
    """(state, seconds per step) over ``steps`` calls of ``step(state, batch)``, read one step late."""
    late = OneStepLate()
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
        late.push(metrics["loss"])
    late.flush()
    return state, (time.perf_counter() - start) / steps


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (which must wait for its own result) over ``repeats``, after a warm-up."""
    fn()  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
