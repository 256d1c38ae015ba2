"""Where a call's batches come from: the host loader, or the split held on the devices.

``HostFeed``: the loader builds each batch on the host; a call of k steps
gets k of them stacked ``[k, batch, ...]``, copied in one transfer by the
prefetch thread. ``DeviceFeed``: the split is placed on the devices once
(``jaxtrain.data.on_device``); at an epoch's start the epoch's example
indices (int32, the loader's own order) are copied there, and each call
gathers its k batches on the devices: inside the epoch nothing is copied
from the host. Both give the same batches, bit for bit.

``feed.epoch(epoch, start, sizes)`` yields ``(k, batches)`` per call, placed
as ``feed.run(state, k, batches)`` takes them (the device feed's: a call
that gathers them, so that fetching one waits for nothing).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.data import on_device
from jaxtrain.data.prefetch import prefetch_to_device
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import devices
from jaxtrain.train import calls


class HostFeed:
    """The loader's batches, ``k`` per call stacked on the host, ``prefetch`` calls ahead in a thread."""

    def __init__(self, trainer, loader, prefetch: int):
        self.trainer, self.loader, self.prefetch = trainer, loader, prefetch

    def _place(self, call: tuple[int, dict]) -> tuple[int, dict]:
        size, batches = call
        return size, self._plan(size).shard(batches)

    def epoch(self, epoch: int, start: int, sizes: list[int]):
        host = calls.stacked(self.loader.epoch(epoch, start=start), sizes)
        if self.prefetch > 0:
            return prefetch_to_device(host, self._place, self.prefetch)
        return (self._place(call) for call in host)

    def _plan(self, size: int):
        return self.trainer.batch_plan if size == 1 else self.trainer.steps_plan

    def guard(self):
        """What may cross from the host while a call's batches are fetched and its steps run: the batches, here
        (the loop's own guard refuses any implicit copy)."""
        return contextlib.nullcontext()

    def run(self, state, size: int, batches: dict):
        if size == 1:
            return self.trainer.step(state, batches)
        return self.trainer.placed_steps(state, batches)


class DeviceFeed(HostFeed):
    """The loader's split on the devices (replicated: each device gathers its own rows without a collective),
    its batches gathered there, its augmentation drawn from its seed as the loader draws it."""

    def __init__(self, trainer, loader):
        if loader.transform is not None:
            raise ConfigError("data on the device: this loader transforms its batches on the host (transform=); "
                              "train with the data on the host")
        super().__init__(trainer, loader, prefetch=0)
        self.augment = loader.augment or "none"
        self.data = on_device.place(loader.split, _untyped(trainer.batch_plan.replicated))
        seed = loader.seed
        self._gathers = {
            plan.steps_axis: jax.jit(lambda data, index, epoch: on_device.train_batch(
                data, index, seed, epoch, self.augment), out_shardings=_untyped(plan.batch))
            for plan in (trainer.batch_plan, trainer.steps_plan)}
        self._programs = {}  # calls' steps -> the compiled gather
        self._typed = {plan.steps_axis: None if plan.batch == _untyped(plan.batch) else plan.batch
                       for plan in (trainer.batch_plan, trainer.steps_plan)}  # an Explicit mesh's: retype to it

    def guard(self):
        """Nothing: the split and the epoch's indices are on the devices already, so even an explicit copy from
        the host is an error while a call is fetched and run."""
        return jax.transfer_guard_host_to_device("disallow_explicit")

    def epoch(self, epoch: int, start: int, sizes: list[int]):
        """Every call's indices copied now (before the epoch's transfer guard); the batches gathered per call."""
        if not sizes:
            return (call for call in ())
        index = on_device.train_indices(self.loader, epoch, start, sum(sizes))
        placed = [(size, on_device.put(rows[0] if size == 1 else rows, _untyped(self._plan(size).batch)))
                  for size, rows in zip(sizes, np.split(index, np.cumsum(sizes)[:-1]))]
        epoch_number = on_device.put(np.int32(epoch), _untyped(self.trainer.batch_plan.replicated))
        gathers = {size: self._compiled(size, rows, epoch_number) for size, rows in placed}  # compiled now
        return ((size, functools.partial(gathers[size], self.data, rows, epoch_number)) for size, rows in placed)

    def run(self, state, size: int, gather):
        """The call's batches gathered, then its steps: both the devices' work, none of it data wait (typed as
        the step takes them: ``explicit``'s mesh, where the gather ran on the same mesh untyped)."""
        batches, typed = gather(), self._typed[size > 1]
        return super().run(state, size, batches if typed is None else jax.device_put(batches, typed))

    def _compiled(self, size: int, rows: jax.Array, epoch_number: jax.Array):
        if size not in self._programs:
            self._programs[size] = self._gathers[size > 1].lower(self.data, rows, epoch_number).compile()
        return self._programs[size]


class DeviceEval:
    """The test split on the devices; an evaluation's batches gathered there in one call (padded and masked as
    the loader pads them: ``on_device.eval_batch``), then evaluated one by one: nothing copied from the host.
    Stands where ``evaluate`` takes a loader (``epoch(epoch)``)."""

    def __init__(self, evaluator, loader):
        self.plan = evaluator.batch_plan
        self.data = on_device.place(loader.split, _untyped(self.plan.replicated))
        count, size = len(loader), loader.batch_size
        self._gather = jax.jit(lambda data: [on_device.eval_batch(data, b, size) for b in range(count)],
                               out_shardings=_untyped(self.plan.batch))  # a list: no index crosses from the host

    def epoch(self, epoch: int):
        batches, typed = self._gather(self.data), self.plan.batch
        return iter(batches if typed == _untyped(typed) else jax.device_put(batches, typed))


def _untyped(sharding: NamedSharding) -> NamedSharding:
    """``sharding`` on its mesh with Auto axes: the gathers index across the sharded batch axis, which an
    Explicit mesh (``strategy="explicit"``) would make a sharding type error; same devices, same layout."""
    return NamedSharding(devices.typed(sharding.mesh, explicit=False), sharding.spec)
