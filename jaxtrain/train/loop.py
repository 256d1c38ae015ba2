"""fit / evaluate: the host loop around compiled steps, with hooks.

Results are read one step late (``jaxtrain.train.timing.OneStepLate``): at most 2
steps are in flight. What happens around the steps (logging, checkpoints,
stop checks) are ``Hook``s with a period, called with the ``Loop``'s view.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm  # a notebook's widget where ipywidgets is installed, else text

from jaxtrain.choices import LABELS_OUT_OF_RANGE
from jaxtrain.core.precision import all_finite
from jaxtrain.data.prefetch import prefetch_to_device
from jaxtrain.errors import Diverged
from jaxtrain.parallel import call_checks
from jaxtrain.train import calls, feeds
from jaxtrain.train.timing import Chrono, OneStepLate

_all_finite = jax.jit(all_finite)


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
    checkpoint_sec: float = 0.0  # pauses of the epoch to save (not in train_sec)
    start_up_sec: float = 0.0  # the loader's start before its first batch (in train_sec, not in data_wait_sec)
    compile_sec: float = 0.0  # JAX tracing and compiling as the epoch's calls are made (not in train_sec)


def device_batches(batches: Iterable[dict], plan, prefetch: int):
    """Host batches -> sharded device batches, placed and checked as ``plan`` says (a trainer's or evaluator's
    ``batches``): ``prefetch`` ahead in a thread, or (0) in line."""
    if prefetch > 0:
        return prefetch_to_device(batches, plan.shard, prefetch)
    return (plan.shard(b) for b in batches)


def check_finite(params, step: int) -> None:
    """``Diverged`` if a parameter is NaN or infinite: an update overflowed, though every loss read was finite."""
    if not jax.device_get(_all_finite(params)):
        raise Diverged("the parameters became NaN or infinite", step)


def evaluate(evaluator, state, batches: Iterable[dict], prefetch: int = 2) -> dict:
    """Means of the eval metrics over every unmasked example, plus ``count``.

    ``batches`` are host batches (this process's rows); they reach the devices
    through ``device_batches``, and the eval step runs under
    ``jax.transfer_guard("disallow")``. Labels outside the model's classes
    (an eval_fn's per-example ``LABELS_OUT_OF_RANGE``, as
    ``classify.per_example`` gives it) are a ``ConfigError`` naming their
    share, not a NaN loss.
    """
    if any(x.is_deleted() for x in jax.tree.leaves(state) if isinstance(x, jax.Array)):  # jaxlib would crash
        raise ValueError("evaluate: this state was donated to a later train step (its buffers are gone): evaluate "
                         "the newest state, or keep a copy (jax.tree.map(jnp.copy, state)) before the next step")
    totals: dict[str, float] = {}

    def add(read):
        if read is not None:
            for k, v in read[0].items():
                totals[k] = totals.get(k, 0.0) + float(v)

    late = OneStepLate()
    placed = device_batches(batches, evaluator.batch_plan, prefetch)
    with contextlib.closing(placed) as it, jax.transfer_guard("disallow"):
        for batch in it:
            add(late.push(evaluator.step(state, batch)))
    add(late.flush())
    count = totals.pop("count", 0.0)
    outside = totals.pop(LABELS_OUT_OF_RANGE, 0.0)
    if outside:
        call_checks.labels(outside / count, "the evaluation set")
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


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(loop)`` every ``every`` steps (``unit="step"``, after the call that ran the step was dispatched) or
    epochs (``"epoch"``, after the evaluation, ``loop.stats`` set). A step hook that needs the newest step's
    metrics calls ``loop.sync()``. A step hook ``cuts`` calls where it is due (``jaxtrain.train.calls``: a
    call of several steps ends there), and after each step of ``at``; one that does not runs after each call
    that passed a due step."""

    fn: Callable[[Loop], None]
    every: int = 1
    unit: str = "step"
    cuts: bool = True
    at: tuple[int, ...] = ()  # steps after which a call ends as well (a profile's start and stop)

    def due(self, unit: str, count: int, before: int | None = None) -> bool:
        """Whether a multiple of ``every`` lies in (``before``, ``count``]: the steps (or epochs) since the last
        call (default: ``count`` alone)."""
        before = count - 1 if before is None else before
        return unit == self.unit and count // self.every > before // self.every


_NO_SUMS = {"loss": 0.0, "accuracy": 0.0, "steps": 0, "examples": 0}


class Loop:
    """The loop as hooks see it: ``state``, ``epoch``, ``total_steps``, ``recent`` (the newest metrics read,
    one step late), ``chrono``, ``stats`` (at an epoch's end), ``evaluated``; ``sync()``, ``position()``."""

    def __init__(self, state, epochs: int, max_steps: int | None, steps_per_epoch: int, position: Position,
                 bar_factory: Callable, starts: Callable[[], int] = lambda: 0):
        self.state, self.epochs, self.max_steps, self.steps_per_epoch = state, epochs, max_steps, steps_per_epoch
        self.total_steps, self.first_loss = position.total_steps, position.first_loss
        self.history = [EpochStats(**h) for h in position.history]
        self.recent: dict = {}
        self.call_size = 0  # the steps of the newest call (``total_steps - call_size``: the steps before it)
        self.evaluated: dict = {}  # the newest evaluation's result (``evaluation``)
        self.stats: EpochStats | None = None
        self._late, self._bar_factory = OneStepLate(), bar_factory
        self._starts = starts  # the train loader's count of pipeline starts (its start-up is not data wait: Chrono)

    def start_epoch(self, epoch: int, batch: int, partial: dict | None) -> None:
        self.epoch, self.batch, self.stats = epoch, batch, None
        self.sums = {k: (partial or _NO_SUMS).get(k, v) for k, v in _NO_SUMS.items()}
        self.chrono = Chrono(partial, self._starts)
        self.bar = self._bar_factory(epoch, batch)

    @property
    def last_of_epoch(self) -> bool:
        """The newest step ends this epoch's training (its last batch, or ``max_steps``)."""
        return self.batch >= self.steps_per_epoch or self.max_steps is not None and self.total_steps >= self.max_steps

    def stepped(self, state, metrics, batch_size: int, size: int = 1) -> None:
        """The call of ``size`` steps (``metrics``: ``[size]`` each where size > 1) was dispatched."""
        self.state, self.call_size = state, size
        self.batch += size
        self.total_steps += size
        self._record(self._late.push(metrics, batch_size, size, self.total_steps - size))

    def sync(self) -> None:
        """Read the newest call's metrics now (waits for it): before saving a position that counts it."""
        self._record(self._late.flush())

    def _record(self, read) -> None:
        if read is None:
            return
        metrics, batch_size, size, before = read
        for step, m in enumerate(calls.rows(metrics, size), before + 1):
            if LABELS_OUT_OF_RANGE in m:
                call_checks.labels(m[LABELS_OUT_OF_RANGE], f"the batch of step {step}")
            loss = float(m["loss"])
            if not math.isfinite(loss) and float(m.get("grads_finite", 1.0)) != 0.0:  # fp16 skips its overflows
                raise Diverged(f"the loss became {loss}", step)
            self.recent = m
            self.first_loss = loss if self.first_loss is None else self.first_loss
            for k in ("loss", "accuracy"):
                self.sums[k] += float(m.get(k, np.nan))
            self.sums["steps"] += 1
            self.sums["examples"] += batch_size
        self.bar.update(size)
        if not self.bar.disable:  # no string formatting in the hot loop when nobody sees it
            sec = max(self.chrono.train_sec, 1e-9)
            self.bar.set_postfix(loss=f"{self.sums['loss'] / self.sums['steps']:.4f}",
                                 ex_per_s=f"{self.sums['examples'] / sec:,.0f}",
                                 data_wait=f"{100 * self.chrono.wait_fraction:.0f}%", refresh=False)

    def position(self) -> Position:
        """Where to resume from here: inside the epoch, or (at the end of a whole epoch) the next one."""
        history = [dataclasses.asdict(h) for h in self.history]
        result = dataclasses.asdict(self.stats) if self.stats else {}
        if self.stats is not None and self.batch >= self.steps_per_epoch:
            return Position(self.epoch + 1, 0, self.total_steps, self.first_loss, history, {}, result)
        if self.stats is not None:  # stopped by max_steps: this epoch is not history yet
            history = history[:-1]
        return Position(self.epoch, self.batch, self.total_steps, self.first_loss, history,
                        {**self.sums, **self.chrono.state()}, result)


def fit(trainer, state, train_loader, evaluator, test_loader, *, epochs: int, max_steps: int | None = None,
        hooks: Sequence[Hook] = (), on_epoch: Callable[[EpochStats], None] | None = None,
        progress: bool | None = None, prefetch: int = 2, position: Position | None = None, eval_every: int = 1,
        pause: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext, steps_per_call: int = 1,
        data_on_device: bool = False):
    """Train for ``epochs`` (or until ``max_steps`` in total), evaluating every ``eval_every`` epochs and after
    the last (``evaluator`` None: never).

    The hot loop runs under ``jax.transfer_guard("disallow")``: batches reach
    the devices only through ``device_batches`` (explicit copies, ``prefetch``
    ahead in a background thread), so a stray host array fails loudly instead
    of being copied each step; the time spent waiting for a batch is
    ``data_wait_fraction``, less the loader's start-up (``start_up_sec``: the
    wait during which ``train_loader.starts`` moved; a loader without it has
    none). ``hooks`` run every N steps / epochs;
    ``on_epoch(stats)`` is the common epoch hook; each runs inside ``pause()``
    (a run's stall watch: an evaluation is not a stall). ``steps_per_call``:
    up to this many steps in one compiled call (``trainer.placed_steps``),
    calls cut where a hook is due (``jaxtrain.train.calls``); a hook that
    does not cut, e.g. a stop request, runs after the call. ``data_on_device``:
    the train and test splits are placed on the devices once; each call
    gathers its batches there, and each evaluation all of its batches at
    once (``jaxtrain.train.feeds``: the loaders' batches, bit for bit; an
    in-memory split only). ``position`` resumes
    a run where a checkpoint left it. A NaN or infinite loss, evaluation loss,
    or parameters at an epoch's end raise ``Diverged``; labels outside the
    model's classes a ``ConfigError`` first (each step's read one step late
    with its loss, and ``trainer.check_labels()`` at each epoch's end; the
    evaluation's by ``evaluate``, before its loss).

    Returns ``(state, history, first_loss)``: the final state, one EpochStats
    per epoch, and the loss of the very first step.
    """
    pos = position or Position()
    tests = feeds.DeviceEval(evaluator, test_loader) if data_on_device and evaluator else test_loader
    hooks = [*([evaluation(evaluator, tests, eval_every, prefetch=0 if data_on_device else prefetch)]
               if evaluator else []),
             *([Hook(lambda loop: on_epoch(loop.stats), unit="epoch")] if on_epoch else []), *hooks]

    def bar(epoch, batch):
        return tqdm(total=len(train_loader), initial=batch, desc=f"epoch {epoch}/{epochs}", unit="step",
                    disable=None if progress is None else not progress,  # None: only on a terminal
                    leave=False, mininterval=0.5)

    loop = Loop(state, epochs, max_steps, len(train_loader), pos, bar, lambda: getattr(train_loader, "starts", 0))
    feed = feeds.DeviceFeed(trainer, train_loader) if data_on_device else feeds.HostFeed(trainer, train_loader,
                                                                                          prefetch)
    cuts = [hook.every for hook in hooks if hook.unit == "step" and hook.cuts]
    points = sorted({step for hook in hooks for step in hook.at})
    for epoch in range(pos.epoch, epochs + 1):
        resuming = epoch == pos.epoch and pos.batch > 0
        if max_steps is not None and loop.total_steps >= max_steps and not (resuming and not pos.result):
            if resuming:  # evaluated there already: its epoch, cut short, is the history's last
                loop.stats = EpochStats(**pos.result)
                loop.history.append(loop.stats)
            break  # a resumed epoch not yet evaluated ends (and is evaluated) at max_steps too
        loop.start_epoch(epoch, pos.batch if resuming else 0, pos.partial if resuming else None)
        sizes = calls.call_sizes(loop.batch, loop.total_steps, len(train_loader), max_steps, cuts, steps_per_call,
                                 points)
        with loop.chrono.compiling():  # data on the device: the gathers of new call sizes compile here
            batches = feed.epoch(epoch, loop.batch, sizes)
        with contextlib.closing(loop.bar), contextlib.closing(batches), jax.transfer_guard("disallow"):
            while not loop.last_of_epoch:
                with loop.chrono.waiting(), jax.profiler.TraceAnnotation("data_wait"), feed.guard():
                    size, batch = next(batches, (0, None))
                if batch is None:
                    break
                with jax.profiler.StepTraceAnnotation("train_step", step_num=loop.total_steps + 1), feed.guard(), \
                        loop.chrono.compiling():  # a program's first call compiles it: off the clock
                    out = feed.run(loop.state, size, batch)
                loop.stepped(*out, train_loader.batch_size, size)
                for hook in hooks:
                    if hook.due("step", loop.total_steps, loop.total_steps - size):
                        with pause():
                            hook.fn(loop)
            loop.sync()
            trainer.check_labels()  # the trainer's own check, the last calls' too (the loop read each with its loss)
        check_finite(loop.state.params, loop.total_steps)  # the last update of an epoch has no loss read after it
        _end_epoch(loop)
        for hook in hooks:
            if hook.due("epoch", epoch):
                with pause():
                    hook.fn(loop)
    return loop.state, loop.history, loop.first_loss


def _end_epoch(loop: Loop) -> None:
    sums, chrono = loop.sums, loop.chrono
    loop.stats = EpochStats(
        epoch=loop.epoch, steps=sums["steps"], examples=sums["examples"],
        train_loss=sums["loss"] / max(sums["steps"], 1), train_acc=sums["accuracy"] / max(sums["steps"], 1),
        test_loss=float("nan"), test_acc=float("nan"), test_examples=0, train_sec=chrono.train_sec, eval_sec=0.0,
        data_wait_sec=chrono.wait, data_wait_fraction=chrono.wait_fraction,
        checkpoint_sec=chrono.pauses.get("checkpoint", 0.0), compile_sec=chrono.pauses.get("compile", 0.0),
        start_up_sec=chrono.start_up)
    loop.history.append(loop.stats)


def evaluation(evaluator, test_loader, every: int = 1, unit: str = "epoch", prefetch: int = 2,
               on_result: Callable[[Loop, dict], None] | None = None) -> Hook:
    """Evaluate on ``test_loader`` every ``every`` epochs (and after the run's last) or steps.

    An epoch's evaluation fills its ``EpochStats``' test fields; a step's is a pause of the epoch's clock.
    Each result (``{"step", "loss", "accuracy", "count", "sec"}``) is ``loop.evaluated`` and goes to
    ``on_result(loop, result)``.
    """
    def run(loop: Loop) -> None:
        last = loop.epoch >= loop.epochs or loop.max_steps is not None and loop.total_steps >= loop.max_steps
        if unit == "epoch" and loop.epoch % every and not last:
            return
        if unit == "step":  # the steps dispatched before it are train time: waited for outside the pause
            loop.sync()
        start = time.perf_counter()
        with loop.chrono.paused("eval") if unit == "step" else contextlib.nullcontext(), \
                jax.profiler.TraceAnnotation("eval"):
            test = evaluate(evaluator, loop.state, test_loader.epoch(loop.epoch), prefetch)
        if test["count"] and not math.isfinite(test.get("loss", 0.0)):
            raise Diverged(f"the evaluation's loss became {test['loss']}", loop.total_steps)
        loop.evaluated = {"step": loop.total_steps, **test, "sec": time.perf_counter() - start}
        if unit == "epoch":
            loop.stats.test_loss, loop.stats.test_acc = test.get("loss", np.nan), test.get("accuracy", np.nan)
            loop.stats.test_examples, loop.stats.eval_sec = test["count"], loop.evaluated["sec"]
        if on_result is not None:
            on_result(loop, loop.evaluated)

    return Hook(run, every if unit == "step" else 1, unit)


def checkpoint_hooks(save: Callable[[object, Position], None] | None, every: int | None = None,
                     should_stop: Callable[[], bool] | None = None) -> list[Hook]:
    """Save every ``every`` steps and at each epoch's end; when ``should_stop()`` turns true (checked after
    each call: at most its steps late), save and raise ``Interrupted``. The time saving takes is a pause of the
    epoch's clock."""
    saved = [None]

    def save_here(loop: Loop) -> None:
        if save is None or saved[0] == (loop.total_steps, loop.stats is not None):
            return
        loop.sync()  # the checkpoint's sums include the newest step
        with loop.chrono.paused("checkpoint"):
            save(loop.state, loop.position())
        saved[0] = (loop.total_steps, loop.stats is not None)

    def periodic(loop: Loop) -> None:
        if not loop.last_of_epoch:  # the last step of an epoch is saved after its evaluation
            save_here(loop)

    def check(loop: Loop) -> None:
        if should_stop():
            save_here(loop)
            raise Interrupted(loop.position())

    periodic_hooks = [Hook(periodic, every)] if save is not None and every else []
    stop_hooks = [Hook(check, cuts=False)] if should_stop is not None else []
    return periodic_hooks + stop_hooks + ([Hook(save_here, unit="epoch")] if save else [])
