"""What the step benchmarks of experiments/ share: their command line's common flags, timing the variants
interleaved, and the JSON beside the printed table.

A benchmark declares its flags (``parser``), builds one ``Timed`` per variant (a step, its state, a batch
already on the devices), and hands them to ``interleave``: every variant is warmed up (compiled), then the
repeats take turns (A B C A B C ...), so that machine noise hits every variant alike. Each variant's figure is
the median of its repeats, its spread the min-max (``spread``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Iterable

from jaxtrain.cli import positive_int


UNROLL = {"auto": None, "on": True, "off": False}  # --unroll -> unroll= (None: each bench says where it applies)


def parser(prog: str, doc: str, *, steps: int, repeats: int, json_out: str = "the results") -> argparse.ArgumentParser:
    """``python -m experiments.PROG``'s parser (its description the docstring's first line) with ``--steps``,
    ``--repeats`` and ``--json``; the benchmark adds its own flags."""
    p = argparse.ArgumentParser(prog=f"python -m experiments.{prog}", description=doc.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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


def warm_up(run: Timed, steps: int = 1) -> Timed:
    """``run`` after ``steps`` steps (the first compiles), untimed."""
    from jaxtrain.train.timing import time_steps

    run.state, _ = time_steps(run.step, run.state, run.batch, steps)
    return run


def interleave(runs: Iterable[Timed], steps: int, repeats: int) -> None:
    """Time every run ``repeats`` times, ``steps`` steps each, the runs taking turns: fills each run's ``ms``."""
    from jaxtrain.train.timing import time_steps

    runs = list(runs)
    for _ in range(repeats):
        for run in runs:
            run.state, sec = time_steps(run.step, run.state, run.batch, steps)
            run.ms.append(1000 * sec)


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
