"""Where a step's batch and state live: decided once, in a ``Plan``, and read by everything that places.

A trainer makes its plan's batch half when it is built (the mesh, the
micro-batches a call splits each shard into) and the state half once it sees
the state's shapes (the sharding rules give a PartitionSpec per leaf; the
strategy is chosen for them). The trainer, the evaluator, the loop and its
prefetch, the diagnostics, the batch-size finder and the pipeline read the
plan; no other module builds the batch's sharding or checks a batch size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.core.state import TrainState
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel import call_checks, rules, sharding, strategies
from jaxtrain.parallel.devices import batch_axes


@dataclasses.dataclass(frozen=True)
class Plan:
    """The batch's placement (``batch``, ``unit``) and, with a state, the state's (``specs``, ``state``) and
    the strategy that runs it.

    ``micro_batches``: each data shard's rows split into this many inside one call (scan accumulation, a
    pipeline's micro-batches); ``calls_per_update``: calls that make one update (``optax.MultiSteps``);
    ``steps_axis``: every batch array carries a leading axis of steps, one batch per step of a call (K steps per
    call, ``step.scanned``), unsharded, the examples after it (``with_steps_axis``)."""

    mesh: Mesh
    micro_batches: int = 1
    calls_per_update: int = 1
    steps_axis: bool = False
    specs: TrainState | None = None  # a PartitionSpec per state leaf
    strategy: strategies.Strategy | None = None

    @functools.cached_property
    def batch(self) -> NamedSharding:
        """Examples split over "data" (their leading axis, or the one after the steps'; on a hybrid mesh over
        "replica" and "data"), replicated over every other mesh axis."""
        if self.steps_axis:  # [K, examples, ...]: the steps' axis whole on every device
            return NamedSharding(self.mesh, P(None, batch_axes(self.mesh)))
        return NamedSharding(self.mesh, P(batch_axes(self.mesh)))

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @functools.cached_property
    def state(self):
        """A NamedSharding per state leaf."""
        return sharding.named(self.mesh, self.specs)

    @functools.cached_property
    def _state_leaves(self) -> list:
        return jax.tree.leaves(self.state)

    def idle_axes(self) -> list[str]:
        """The mesh axes of 2+ devices that split neither the batch nor any state array: their devices compute the
        same thing (e.g. a "model" axis when no rule shards over it)."""
        used = set(sharding.axes_of(batch_axes(self.mesh))) | sharding.mesh_axes_used(self.specs)
        return [a for a in self.mesh.axis_names if self.mesh.shape[a] > 1 and a not in used]

    def check_placed(self, state) -> None:
        """A ConfigError naming the first array of ``state`` not placed as this plan says (a state another
        trainer made): host-side, a comparison per leaf."""
        call_checks.placement(state, self._state_leaves)

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def data_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in sharding.axes_of(batch_axes(self.mesh)))

    @property
    def unit(self) -> int:
        """A call's global batch is a multiple of this: data shards x micro-batches."""
        return self.data_shards * self.micro_batches

    def check_batch_size(self, size: int) -> None:
        """A ConfigError unless a call's global batch of ``size`` splits evenly over the shards and micro-batches."""
        if size < 1 or size % self.unit:
            shards = f"{self.data_shards} {'devices' if self.data_shards == self.num_devices else 'data shards'}"
            what = shards + (f" x {self.micro_batches} micro-batches" if self.micro_batches > 1 else "")
            lower, upper = size // self.unit * self.unit, (size // self.unit + 1) * self.unit
            example = f"e.g. {lower} or {upper}" if lower else f"e.g. {upper}"
            raise ConfigError(f"batch size {size} does not split evenly over {what}: use a multiple of {self.unit} "
                              f"({example})")

    def call_batch(self, batch_size: int) -> int:
        """The global batch of one call for updates of ``batch_size`` examples (checked)."""
        k = self.calls_per_update
        if batch_size % k:
            raise ConfigError(f"{named('batch_size', batch_size)} does not split into {named('accum_steps', k)} "
                              f"micro-batches: use a multiple of {k}")
        self.check_batch_size(batch_size // k)
        return batch_size // k

    def with_steps_axis(self) -> Plan:
        """This plan for batches stacked on a leading axis of steps (``steps_axis``)."""
        return dataclasses.replace(self, steps_axis=True)

    def steps_of(self, batches: Mapping) -> int:
        """K, the steps' axis of ``batches`` (arrays or shapes): the same for every array, or a ConfigError."""
        return _leading(batches, "steps")

    def shard(self, batch: Mapping) -> dict:
        """A global batch (numpy: this process's rows; or jax arrays), checked, as arrays on the mesh (with
        ``steps_axis``: K of them stacked, checked alike)."""
        if self.steps_axis:
            self.steps_of(batch)
        local = _examples(batch, self.steps_axis)
        is_global = all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch))
        self.check_batch_size(local * (1 if is_global else jax.process_count()))
        return jax.tree.map(self._put, batch)

    def lowered(self, batch: Mapping) -> dict:
        """What a step lowers for: ``batch`` placed (``shard``), or, given shapes (``jax.ShapeDtypeStruct``:
        the GLOBAL batch, compile-only devices), the shapes checked and given the batch's sharding."""
        if not sharding.is_abstract(batch):
            return self.shard(batch)
        if self.steps_axis:
            self.steps_of(batch)
        self.check_batch_size(_examples(batch, self.steps_axis))
        return sharding.abstract(batch, self.batch)

    def per_device(self, batch):
        """A global batch as ``jax.pmap`` takes it, [devices, per device, ...] (users never reshape); with
        ``steps_axis``, [devices, K, per device, ...]: the devices' axis first, where pmap maps."""
        n = self.num_devices

        def split(x):
            if not self.steps_axis:
                return x.reshape(n, x.shape[0] // n, *x.shape[1:])
            return x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]).swapaxes(0, 1)

        return jax.tree.map(split, batch)

    def _put(self, x):
        if isinstance(x, jax.Array):
            return x if x.sharding.is_equivalent_to(self.batch, x.ndim) else jax.device_put(x, self.batch)
        # This process's rows of the global batch (all of it in a 1-process run).
        return jax.make_array_from_process_local_data(self.batch, np.asarray(x))

    def for_state(self, state_shapes: TrainState, *, strategy: str, param_sharding: rules.ParamSharding, tx,
                  model_axes: str = "auto") -> Plan:
        """This batch plan made whole for a state of these shapes: parameters (and Frozen model state) by
        ``param_sharding``, optimizer state after its parameter (ZeRO-1: sharded as fsdp's, the parameters
        replicated), the rest replicated; the strategy for those specs. A ConfigError, before anything compiles,
        if a rule does not fit or the strategy cannot run the sharding."""

        def specs(tree):
            return param_sharding.specs(tree, self.mesh)

        pspecs = specs(state_shapes.params)
        uspecs = param_sharding.specs(state_shapes.params, self.mesh, updated=True)
        state_specs = sharding.state_specs(state_shapes, pspecs, tx, frozen_specs=specs, opt_specs=uspecs)
        strategy = strategies.make_strategy(strategy, self.mesh, pspecs, uspecs, model_axes)
        return dataclasses.replace(self, specs=state_specs, strategy=strategy)

    def describe(self) -> dict:
        """``{"sharded": {name: spec}, "replicated": [names]}`` of the parameters."""
        return sharding.describe(self.specs.params)


def _examples(batch: Mapping, after_steps: bool = False) -> int:
    """The batch's examples axis (its leading one, or the one after the steps'): the same for every array, or a
    ConfigError."""
    return _leading(batch, "examples", int(after_steps))


def _leading(batch: Mapping, what: str, axis: int = 0) -> int:
    """The size of ``batch``'s axis ``axis`` (``what`` it counts): the same for every array, or a ConfigError."""
    shapes = [tuple(x.shape if hasattr(x, "shape") else np.shape(x)) for x in jax.tree.leaves(batch)]
    where = "leading" if axis == 0 else "second"
    if any(len(s) <= axis for s in shapes):
        hint = ": stack the steps' batches on a new leading axis" if what == "steps" else ""
        raise ConfigError(f"every array in the batch needs a {where} ({what}) axis, got shapes {shapes}{hint}")
    sizes = {s[axis] for s in shapes}
    if len(sizes) != 1:
        raise ConfigError(f"every array in the batch needs the same {where} ({what}) axis, got sizes {sorted(sizes)}")
    return int(sizes.pop())
