"""fit / evaluate: the host loop around compiled steps.

At most 2 steps are in flight: metrics of step k-1 are read (which waits for
it) right after step k is dispatched. That keeps the device busy while the
host prepares the next batch, and it avoids XLA:CPU's all-reduce rendezvous
deadlock seen with many steps queued on virtual CPU devices (REFERENCE §3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxtrain.data.prefetch import prefetch_to_device, to_device
from jaxtrain.devices import DATA_AXIS


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
    data_wait_sec: float
    data_wait_fraction: float


def device_batches(batches: Iterable[dict], mesh, prefetch: int):
    """Host batches -> sharded device batches: ``prefetch`` ahead in a thread, or (0) in line."""
    if prefetch > 0:
        return prefetch_to_device(batches, mesh, prefetch)
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    return (to_device(b, sharding) for b in batches)


@contextlib.contextmanager
def _closing(it):
    try:
        yield it
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def evaluate(evaluator, state, batches: Iterable[dict], prefetch: int = 2) -> dict:
    """Means of the eval metrics over every unmasked example, plus ``count``.

    ``batches`` are host batches (this process's rows); they reach the devices
    through ``device_batches``, and the eval step runs under
    ``jax.transfer_guard("disallow")``.
    """
    totals: dict[str, float] = {}

    def add(sums):
        for k, v in jax.device_get(sums).items():
            totals[k] = totals.get(k, 0.0) + float(v)

    pending = None
    with _closing(device_batches(batches, evaluator.mesh, prefetch)) as it, jax.transfer_guard("disallow"):
        for batch in it:
            out = evaluator.step(state, batch)
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
    prefetch: int = 2,
    on_step: Callable[[int], None] | None = None,
):
    """Train for ``epochs`` (or until ``max_steps``), evaluating after each epoch.

    The hot loop runs under ``jax.transfer_guard("disallow")``: batches reach
    the devices only through ``device_batches`` (explicit copies, ``prefetch``
    batches ahead in a background thread), so a stray host array fails
    loudly instead of being copied silently each step. The time spent
    waiting for the next batch is reported as ``data_wait_fraction``.

    ``on_step(n)`` is called after the n-th step's metrics were read.

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
            bar.update(1)
            if on_step is not None:
                on_step(sum(h.steps for h in history) + steps)

        pending = None
        wait = 0.0
        batches = device_batches(train_loader.epoch(epoch), trainer.mesh, prefetch)
        with _closing(batches), jax.transfer_guard("disallow"):
            while max_steps is None or total_steps < max_steps:
                t0 = time.perf_counter()
                batch = next(batches, None)
                wait += time.perf_counter() - t0
                if batch is None:
                    break
                state, metrics = trainer.step(state, batch)
                if pending is not None:
                    record(*pending)
                    bar.set_postfix(loss=f"{sums['loss'] / steps:.4f}",
                                    ex_per_s=f"{examples / (time.perf_counter() - start):,.0f}",
                                    data_wait=f"{100 * wait / (time.perf_counter() - start):.0f}%", refresh=False)
                pending = (metrics, train_loader.batch_size)
                total_steps += 1
            if pending is not None:
                record(*pending)
        train_sec = time.perf_counter() - start
        bar.close()

        start = time.perf_counter()
        test = evaluate(evaluator, state, test_loader.epoch(epoch), prefetch)
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
            data_wait_sec=wait,
            data_wait_fraction=wait / max(train_sec, 1e-9),
        )
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
    return state, history, first_loss
