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
    with contextlib.closing(device_batches(batches, evaluator.mesh, prefetch)) as it, jax.transfer_guard("disallow"):
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


@dataclasses.dataclass
class Position:
    """Where a run stands: what a checkpoint needs, besides the TrainState, to resume exactly."""

    epoch: int = 1  # the epoch in progress (1-based)
    batch: int = 0  # the next batch of that epoch
    total_steps: int = 0
    first_loss: float | None = None
    history: list = dataclasses.field(default_factory=list)  # finished epochs (EpochStats as dicts)
    partial: dict = dataclasses.field(default_factory=dict)  # sums of the epoch in progress
    result: dict = dataclasses.field(default_factory=dict)  # the last evaluation (EpochStats), once there is one


class Interrupted(Exception):
    """Training stopped on request (a signal) after saving a checkpoint at ``position``."""

    def __init__(self, position: Position):
        super().__init__(f"interrupted at step {position.total_steps}")
        self.position = position


def _position(epoch, batch, total_steps, first_loss, history, partial=None, result=None) -> Position:
    return Position(epoch, batch, total_steps, first_loss, [dataclasses.asdict(h) for h in history], partial or {},
                    dataclasses.asdict(result) if result else {})


_NO_SUMS = {"loss": 0.0, "accuracy": 0.0, "steps": 0, "examples": 0, "wait": 0.0, "train_sec": 0.0}


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
    position: Position | None = None,
    save: Callable[[object, Position], None] | None = None,
    save_every: int | None = None,
    should_stop: Callable[[], bool] | None = None,
):
    """Train for ``epochs`` (or until ``max_steps`` in total), evaluating after each epoch.

    The hot loop runs under ``jax.transfer_guard("disallow")``: batches reach
    the devices only through ``device_batches`` (explicit copies, ``prefetch``
    batches ahead in a background thread), so a stray host array fails
    loudly instead of being copied silently each step. The time spent
    waiting for the next batch is reported as ``data_wait_fraction``.

    ``on_step(n)`` is called after the n-th step's metrics were read.
    ``position`` resumes a run where a checkpoint left it. ``save(state,
    position)`` is called every ``save_every`` steps and after each epoch;
    when ``should_stop()`` turns true, the state is saved and ``Interrupted``
    is raised.

    Returns ``(state, history, first_loss)``: the final state, one EpochStats
    per epoch, and the loss of the very first step.
    """
    pos = position or Position()
    history = [EpochStats(**h) for h in pos.history]
    first_loss, total_steps = pos.first_loss, pos.total_steps
    recorded = pos.total_steps  # steps whose metrics were read (one behind total_steps)
    for epoch in range(pos.epoch, epochs + 1):
        if max_steps is not None and total_steps >= max_steps:
            break
        resuming = epoch == pos.epoch and pos.batch > 0
        batch_index = pos.batch if resuming else 0
        sums = dict(pos.partial if resuming else _NO_SUMS)
        bar = tqdm(total=len(train_loader), initial=batch_index, desc=f"epoch {epoch}/{epochs}", unit="step",
                   disable=None if progress is None else not progress,  # None: only on a terminal
                   leave=False, mininterval=0.5)
        start = time.perf_counter()

        def elapsed():
            return sums["train_sec"] + time.perf_counter() - start

        def record(metrics, batch_size):
            nonlocal first_loss, recorded
            m = jax.device_get(metrics)
            first_loss = float(m["loss"]) if first_loss is None else first_loss
            for k in ("loss", "accuracy"):
                sums[k] += float(m.get(k, np.nan))
            sums["steps"] += 1
            sums["examples"] += batch_size
            bar.update(1)
            if not bar.disable:  # no string formatting in the hot loop when nobody sees it
                bar.set_postfix(loss=f"{sums['loss'] / sums['steps']:.4f}",
                                ex_per_s=f"{sums['examples'] / elapsed():,.0f}",
                                data_wait=f"{100 * sums['wait'] / elapsed():.0f}%", refresh=False)
            recorded += 1
            if on_step is not None:
                on_step(recorded)

        def here() -> Position:
            return _position(epoch, batch_index, total_steps, first_loss, history, {**sums, "train_sec": elapsed()})

        pending = None
        batches = device_batches(train_loader.epoch(epoch, start=batch_index), trainer.mesh, prefetch)
        with contextlib.closing(batches), jax.transfer_guard("disallow"):
            while max_steps is None or total_steps < max_steps:
                t0 = time.perf_counter()
                batch = next(batches, None)
                sums["wait"] += time.perf_counter() - t0
                if batch is None:
                    break
                state, metrics = trainer.step(state, batch)
                batch_index += 1
                total_steps += 1
                if pending is not None:
                    record(*pending)
                pending = (metrics, train_loader.batch_size)
                stop = should_stop is not None and should_stop()
                last = batch_index >= len(train_loader) or max_steps is not None and total_steps >= max_steps
                periodic = save_every is not None and total_steps % save_every == 0 and not last  # last: saved below
                if save is not None and (stop or periodic):
                    record(*pending)  # the checkpoint's sums include this step
                    pending = None
                    save(state, here())
                if stop:
                    bar.close()
                    raise Interrupted(here())
            if pending is not None:
                record(*pending)
        train_sec = elapsed()
        bar.close()

        start_eval = time.perf_counter()
        test = evaluate(evaluator, state, test_loader.epoch(epoch), prefetch)
        stats = EpochStats(
            epoch=epoch,
            steps=sums["steps"],
            examples=sums["examples"],
            train_loss=sums["loss"] / max(sums["steps"], 1),
            train_acc=sums["accuracy"] / max(sums["steps"], 1),
            test_loss=test.get("loss", float("nan")),
            test_acc=test.get("accuracy", float("nan")),
            test_examples=test["count"],
            train_sec=train_sec,
            eval_sec=time.perf_counter() - start_eval,
            data_wait_sec=sums["wait"],
            data_wait_fraction=sums["wait"] / max(train_sec, 1e-9),
        )
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
        if save is not None:
            if batch_index >= len(train_loader):  # the epoch is complete: resume at the next one
                save(state, _position(epoch + 1, 0, total_steps, first_loss, history, result=stats))
            else:  # stopped by max_steps: resume inside this epoch, which is not history yet
                save(state, _position(epoch, batch_index, total_steps, first_loss, history[:-1],
                                      {**sums, "train_sec": train_sec}, result=stats))
    return state, history, first_loss
