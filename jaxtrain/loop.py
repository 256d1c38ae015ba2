"""fit / evaluate: the host loop around compiled steps.

At most 2 steps are in flight: metrics of step k-1 are read (which waits for
it) right after step k is dispatched. That keeps the device busy while the
host prepares the next batch, and it avoids XLA:CPU's all-reduce rendezvous
deadlock seen with many steps queued on virtual CPU devices (REFERENCE §3).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np
from tqdm import tqdm


@dataclasses.dataclass
class EpochStats:
    epoch: int
    steps: int
    examples: int
    train_loss: float
    train_acc: float
    test_loss: float
    test_acc: float
    test_examples: int
    train_sec: float
    eval_sec: float


def evaluate(evaluator, state, batches: Iterable[dict]) -> dict:
    """Means of the eval metrics over every unmasked example, plus ``count``."""
    totals: dict[str, float] = {}

    def add(sums):
        for k, v in jax.device_get(sums).items():
            totals[k] = totals.get(k, 0.0) + float(v)

    pending = None
    for batch in batches:
        out = evaluator(state, batch)
        if pending is not None:
            add(pending)  # one step late: <= 2 in flight
        pending = out
    if pending is not None:
        add(pending)
    count = totals.pop("count", 0.0)
    means = {k: v / count for k, v in totals.items()} if count else {k: float("nan") for k in totals}
    return {**means, "count": int(count)}


def fit(
    trainer,
    state,
    train_loader,
    evaluator,
    test_loader,
    *,
    epochs: int,
    max_steps: int | None = None,
    on_epoch: Callable[[EpochStats], None] | None = None,
    progress: bool | None = None,
):
    """Train for ``epochs`` (or until ``max_steps``), evaluating after each epoch.

    Returns ``(state, history, first_loss)``: the final state, one EpochStats
    per epoch, and the loss of the very first step.
    """
    history: list[EpochStats] = []
    first_loss = None
    total_steps = 0
    for epoch in range(1, epochs + 1):
        if max_steps is not None and total_steps >= max_steps:
            break
        sums = {"loss": 0.0, "accuracy": 0.0}
        steps = examples = 0
        bar = tqdm(
            total=len(train_loader),
            desc=f"epoch {epoch}/{epochs}",
            unit="step",
            disable=None if progress is None else not progress,  # None: only on a terminal
            leave=False,
            mininterval=0.5,
        )
        start = time.perf_counter()

        def record(metrics, batch_size):
            nonlocal steps, examples, first_loss
            m = jax.device_get(metrics)
            first_loss = float(m["loss"]) if first_loss is None else first_loss
            for k in sums:
                sums[k] += float(m.get(k, np.nan))
            steps += 1
            examples += batch_size
            rate = examples / max(time.perf_counter() - start, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{sums['loss'] / steps:.4f}", ex_per_s=f"{rate:,.0f}", refresh=False)

        pending = None
        for batch in train_loader.epoch(epoch):
            state, metrics = trainer(state, batch)
            if pending is not None:
                record(*pending)
            pending = (metrics, len(batch["label"]))
            total_steps += 1
            if max_steps is not None and total_steps >= max_steps:
                break
        if pending is not None:
            record(*pending)
        train_sec = time.perf_counter() - start
        bar.close()

        start = time.perf_counter()
        test = evaluate(evaluator, state, test_loader.epoch(epoch))
        stats = EpochStats(
            epoch=epoch,
            steps=steps,
            examples=examples,
            train_loss=sums["loss"] / max(steps, 1),
            train_acc=sums["accuracy"] / max(steps, 1),
            test_loss=test.get("loss", float("nan")),
            test_acc=test.get("accuracy", float("nan")),
            test_examples=test["count"],
            train_sec=train_sec,
            eval_sec=time.perf_counter() - start,
        )
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
    return state, history, first_loss
