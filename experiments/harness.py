"""What the step benchmarks of experiments/ share: their command line's common flags, timing the variants
interleaved, and the JSON beside the printed table.

A benchmark declares its flags (``parser``), builds one ``Timed`` per variant (a step, its state, a batch
already on the devices), and hands them to ``interleave``: every variant is warmed up (compiled), then the
repeats take turns (A B C A B C ...), so that machine noise hits every variant alike. Each variant's figure is
the median of its repeats, its spread the min-max (``spread``). Benchmarks of single calls (an operation, a kernel:
no state) build one ``Call`` per variant and hand them to ``take_turns`` instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable

from jaxtrain.cli import positive_int


UNROLL = {"auto": None, "on": True, "off": False}  # --unroll -> unroll= (None: each bench says where it applies)


def parser(prog: str, doc: str, *, steps: int | None, repeats: int,
           json_out: str = "the results") -> argparse.ArgumentParser:
    """``python -m experiments.PROG``'s parser (its description the docstring's first line) with ``--steps``,
    ``--repeats`` and ``--json`` (no ``--steps`` where ``steps`` is None: benchmarks of single calls); the benchmark
    adds its own flags."""
    p = argparse.ArgumentParser(prog=f"python -m experiments.{prog}", description=doc.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if steps is not None:
        p.add_argument("--steps", type=positive_int, default=steps, help="steps timed per repeat")
    p.add_argument("--repeats", type=positive_int, default=repeats, help="timed repeats (median reported)")
    p.add_argument("--json", default=None, help=f"also write {json_out} as JSON to this file")
    return p


@dataclasses.dataclass
class Timed:
    """One variant: ``step(state, batch) -> (state, metrics)``, its state (carried from repeat to repeat: steps
    donate it) and its batch; ``ms``: milliseconds per step, one figure per repeat."""

    step: Callable
    state: object
    batch: object
    ms: list = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    def time(self, steps: int) -> float:
        """Seconds per step over ``steps`` more steps, their outputs read one step late (``time_steps``). A
        variant timed otherwise (PyTorch in its own process, calls awaited one by one) overrides it."""
        from jaxtrain.train.timing import time_steps

        self.state, sec = time_steps(self.step, self.state, self.batch, steps)
        return sec


def warm_up(run: Timed, steps: int = 1) -> Timed:
    """``run`` after ``steps`` steps (the first compiles), untimed."""
    run.time(steps)
    return run


def interleave(runs: Iterable[Timed], steps: int, repeats: int, *, rotate: bool = False, pause: float = 0.0,
               settle: int = 0, bar: str | None = None) -> None:
    """Time every run ``repeats`` times, ``steps`` steps each, the runs taking turns: fills each run's ``ms``.
    ``rotate``: each repeat starts one run further on (A B C, B C A, C A B ...); ``pause``: seconds of sleep before
    each turn, and ``settle``: untimed steps of its own to start it (worker threads that keep spinning after a
    step go to sleep, the next run's wake up: experiments.bench); ``bar``: a progress bar of the repeats so named
    (on a terminal)."""
    runs = list(runs)
    rounds = range(repeats)
    if bar:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc=bar, unit="round", disable=None, leave=False)
    for r in rounds:
        for run in runs[r % len(runs):] + runs[:r % len(runs)] if rotate else runs:
            if pause:
                time.sleep(pause)
            if settle:
                run.time(settle)
            run.ms.append(1000 * run.time(steps))


def paired(a: Timed, b: Timed) -> float:
    """The median over the repeats of ``a``'s ms over ``b``'s in the same repeat (run seconds apart: what drifts
    between repeats cancels out)."""
    return statistics.median(x / y for x, y in zip(a.ms, b.ms))


class Call(Timed):
    """One variant that carries no state (an operation, a kernel): ``fn(*args)``, each call's result waited for
    (``jax.block_until_ready``; ``synchronous``: returned done already, as PyTorch's CPU operations are, and no JAX
    imported); ``ms``: milliseconds per call, one figure per repeat."""

    def __init__(self, fn: Callable, args: tuple = (), synchronous: bool = False):
        super().__init__(fn, None, args)
        self.synchronous = synchronous

    def time(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            out = self.step(*self.batch)
            if not self.synchronous:
                import jax

                jax.block_until_ready(out)
        return (time.perf_counter() - start) / steps


def take_turns(calls: dict[str, Call], repeats: int, warm: int = 1, in_a_row: bool = False) -> dict[str, float]:
    """Each call ``warm`` times untimed (the first compiles), then ``repeats`` timed, the calls taking turns (A B C
    A B C ...; ``in_a_row``: each call's repeats one after another, its data warm in the caches, as the published
    figures of bench_ops, bench_int8 and bench_kernels were measured): fills each call's ``ms`` and returns each
    one's median, ms."""
    for group in [[call] for call in calls.values()] if in_a_row else [list(calls.values())]:
        for call in group:
            warm_up(call, warm)
        interleave(group, 1, repeats)
    return {name: call.median for name, call in calls.items()}


def spread(ms: list[float]) -> str:
    """``"median (min-max)"`` of milliseconds, one decimal."""
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})"


def progress(text: str) -> None:
    """A progress line on stderr (stdout holds the table)."""
    print(text, file=sys.stderr, flush=True)


def write_json(path: str | None, results) -> None:
    """``results`` to ``path`` as JSON (nothing without a path: ``--json`` not given)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
