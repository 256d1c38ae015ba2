"""Parallel strategies: where the step's gradients are reduced, and how; each strategy one small object.

The step (``jaxtrain.core.step``) reduces the gradients itself, the code for every strategy in that file. A
strategy hands it a ``Reduction``: a value saying whether one program sees the global batch (XLA inserting
the collectives) or each device its shard, with which collectives (``Comm``: ``lax``'s or our ring's) and
which wrapping. It compiles the whole step with the state's shardings (``placement.py``), and makes the eval
step:

- ``jit`` and ``explicit``: one program; ``explicit`` types the shardings (the mesh's axes Explicit, the step
  traced under ``jax.set_mesh``) and ``reshard``s where ``jit`` constrains. A model that knows no mesh runs under
  ``auto_axes`` (``model_axes="auto"``); ``model_axes="explicit"`` hands it the typed arrays.
- ``shard_map`` and ``ring``: ``jax.shard_map`` over the batch axes, ``lax``'s collectives or the ring's.
- ``pmap``: the legacy API, replicated state only; the update runs inside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.choices import MODEL_AXES, STRATEGIES
from jaxtrain.core.context import auto_axes
from jaxtrain.core.step import Reduction
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel import sharding
from jaxtrain.parallel.collectives import Comm, make_comm
from jaxtrain.parallel.compiled import Compiled, Pmapped, UnderMesh
from jaxtrain.parallel.devices import DATA_AXIS, batch_axes


def check_strategy(strategy: str, model_axes: str = "auto") -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown {named('strategy', repr(strategy))}: use one of {', '.join(STRATEGIES)}")
    if model_axes not in MODEL_AXES:
        raise ConfigError(f"unknown model_axes={model_axes!r}: use one of {', '.join(MODEL_AXES)}")
    if model_axes == "explicit" and strategy != "explicit":
        raise ConfigError("model_axes='explicit' hands the model typed (Explicit) shardings, which only "
                          f"{named('strategy', repr('explicit'))} has: use {named('strategy', repr('explicit'))}, or "
                          "model_axes='auto'")


def _comm(strategy, ring: bool = False) -> Comm:
    return make_comm(sharding.data_dims(strategy.pspecs), ring=ring, grad_dims=sharding.data_dims(strategy.gspecs),
                     batch=batch_axes(strategy.mesh), shard=sharding.fsdp_axes((strategy.pspecs, strategy.gspecs)))


class Strategy:
    """One strategy's collectives and wrapping over ``mesh``, for the parameter specs ``pspecs`` and the specs
    ``gspecs`` of the gradients it hands the update (the optimizer state's: ZeRO-1's differ from ``pspecs``).

    ``reduction(state_specs, per_device)``: where and how the step reduces its gradients (``Reduction``);
    ``compile(step, plan)``: the whole step, compiled with the plan's shardings (the state donated);
    ``carried(step, plan)``: the step as a loop of K steps per call runs it (its new state typed as the one it took);
    ``evaluate(sums, plan, mspecs)``: an eval step's sums over every device's examples."""

    name = ""

    def __init__(self, mesh, pspecs, gspecs=None):
        self.mesh, self.pspecs = mesh, pspecs
        self.gspecs = pspecs if gspecs is None else gspecs

    def model(self, fn: Callable) -> Callable:
        """The loss_fn or eval_fn as this strategy traces it (``explicit``: under ``auto_axes``, knowing no mesh)."""
        return fn

    def reduction(self, state_specs, per_device: bool) -> Reduction:
        """How the step reduces its gradients: per device, or (``jit``, ``explicit`` unless ``per_device``) in one
        program on global arrays; ``state_specs``: the state's placement."""
        raise NotImplementedError

    def _per_device(self, wrap: Callable, state_dims=None, ring: bool = False) -> Reduction:
        return Reduction(self.mesh, model=self.model, wrap=wrap, comm=_comm(self, ring), axes=batch_axes(self.mesh),
                         state_dims=state_dims)

    def compile(self, step: Callable, plan) -> Compiled:
        """``step(state, batch)`` over global arrays, the state donated and kept in its shardings."""
        return Compiled(jax.jit(step, in_shardings=(plan.state, plan.batch),
                                out_shardings=(plan.state, plan.replicated), donate_argnums=(0,)))

    def carried(self, step: Callable, plan) -> Callable:
        """``step`` as ``lax.scan`` carries its state (``step.scanned``): the state it returns has the type of the
        one it took (here already; ``explicit`` types shardings)."""
        return step

    def evaluate(self, local_sums: Callable, plan, mspecs=P()) -> Compiled:
        """``local_sums(params, model_state, batch) -> sums`` over the examples given, summed over the devices;
        ``mspecs``: how the model state is placed (Frozen parts may be sharded like the params)."""
        raise NotImplementedError


class Jit(Strategy):
    name = "jit"

    def _manual(self, fn, in_specs, out_specs):
        """``fn`` per device along the batch axes only; other mesh axes stay with GSPMD (tensor parallelism)."""

        def only_data(specs):
            return jax.tree.map(sharding.data_only, specs, is_leaf=sharding.is_spec)

        batch = set(sharding.axes_of(batch_axes(self.mesh)))
        manual = frozenset(batch) if set(self.mesh.axis_names) - batch else frozenset()

        def mapped(*args):
            context = jax.sharding.get_abstract_mesh()  # explicit: the mesh as typed where this is traced
            return jax.shard_map(fn, mesh=context if context.axis_names else self.mesh, in_specs=only_data(in_specs),
                                 out_specs=only_data(out_specs), axis_names=manual)(*args)

        return mapped

    def _constrain(self, tree, shardings):
        return lax.with_sharding_constraint(tree, shardings)

    def _whole(self, specs):
        """Shardings of ``specs`` gathered over the batch axes (other axes, e.g. "model", kept)."""
        return sharding.named(self.mesh, jax.tree.map(sharding.without_data, specs, is_leaf=sharding.is_spec))

    def reduction(self, state_specs, per_device):
        mspecs = state_specs.model_state
        if per_device:  # left to GSPMD, every micro-batch's gradient would be reduced (k times the bytes)
            return self._per_device(lambda fn: self._manual(fn, (self.pspecs, mspecs, P(), P(batch_axes(self.mesh)),
                                                                 P()), (self.gspecs, P(), mspecs, P())),
                                    sharding.data_dims(mspecs))
        placed = {"params": self._whole(self.pspecs), "model_state": self._whole(mspecs),
                  "grads": sharding.named(self.mesh, self.gspecs)}
        return Reduction(self.mesh, model=self.model, place=lambda tree, what: self._constrain(tree, placed[what]))

    def evaluate(self, local_sums, plan, mspecs=P()):
        return Compiled(jax.jit(lambda state, batch: local_sums(state.params, state.model_state, batch),
                                out_shardings=plan.replicated))


class Explicit(Jit):
    """``jit`` typed: the step traced and run under ``jax.set_mesh`` on the mesh with Explicit axes, the gathers
    and the reductions ``jax.sharding.reshard``s of the types (``_constrain``). The model runs under ``auto_axes``
    unless ``model_axes="explicit"``; accumulation per device as ``jit``'s (``shard_map``: manual mode)."""

    name = "explicit"

    def __init__(self, mesh, pspecs, gspecs=None, model_axes: str = "auto"):
        super().__init__(mesh, pspecs, gspecs)
        self.model_axes = model_axes

    def model(self, fn):
        return auto_axes(fn) if self.model_axes == "auto" else fn

    def _constrain(self, tree, shardings):
        return jax.sharding.reshard(tree, shardings)

    def reduction(self, state_specs, per_device):
        inner = super().reduction(state_specs, per_device)
        others = tuple(a for a in self.mesh.axis_names if a not in sharding.BATCH_AXES)
        if not (per_device and others):
            return inner
        # Accumulation runs per device (shard_map over "data"); jax's psum_scatter cannot type a gradient that is
        # also Explicit over "model" there, so the other axes turn Auto around it, their placement restored after.
        out = (self.gspecs, P(), state_specs.model_state, P())
        return dataclasses.replace(inner, wrap=lambda fn: jax.sharding.auto_axes(inner.wrap(fn), axes=others,
                                                                                  out_sharding=out))

    def compile(self, step, plan):
        return UnderMesh(super().compile(step, plan), self.mesh, self.model_axes)

    def carried(self, step, plan):
        """The new state resharded to the state's own placement: its type is the carry's (ZeRO-1's update leaves the
        parameters sharded where a single step's ``out_shardings`` gathers them)."""

        def kept(state, batch):
            new_state, metrics = step(state, batch)
            return self._constrain(new_state, plan.state), metrics

        return kept

    def evaluate(self, local_sums, plan, mspecs=P()):
        gathered, gathered_state, sums = self._whole(self.pspecs), self._whole(mspecs), self.model(local_sums)
        return UnderMesh(Compiled(jax.jit(lambda state, batch: sums(
            self._constrain(state.params, gathered), self._constrain(state.model_state, gathered_state), batch),
            out_shardings=plan.replicated)), self.mesh, self.model_axes)


class ShardMap(Strategy):
    name = "shard_map"
    ring = False

    def __init__(self, mesh, pspecs, gspecs=None):
        super().__init__(mesh, pspecs, gspecs)
        used = sharding.mesh_axes_used(pspecs) | sharding.mesh_axes_used(self.gspecs)
        other = sorted(used - set(sharding.BATCH_AXES))
        if other:
            raise ConfigError(f"{named('strategy', repr(self.name))} shards parameters over {DATA_AXIS!r} only "
                              f"(fsdp), but the rules name {', '.join(map(repr, other))}: use "
                              f"{named('strategy', repr('jit'))} for tensor parallelism")

    def _map(self, fn, in_specs, out_specs):
        # ppermute results are typed "varying" even when all devices hold the
        # same values, so the ring's outputs cannot be checked as P().
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=not self.ring)

    def reduction(self, state_specs, per_device):
        mspecs = state_specs.model_state
        return self._per_device(lambda fn: self._map(fn, (self.pspecs, mspecs, P(), P(batch_axes(self.mesh)), P()),
                                                     (self.gspecs, P(), mspecs, P())),
                                sharding.data_dims(mspecs), self.ring)

    def evaluate(self, local_sums, plan, mspecs=P()):
        comm = _comm(self, self.ring)
        state_dims = sharding.data_dims(mspecs)

        def run(params, model_state, batch):
            whole_state = model_state if state_dims is None else comm.gather_like(model_state, state_dims)
            return comm.sum(local_sums(comm.gather(params), whole_state, batch))

        mapped = self._map(run, (self.pspecs, mspecs, P(batch_axes(self.mesh))), P())
        return Compiled(jax.jit(lambda state, batch: mapped(state.params, state.model_state, batch)))


class Ring(ShardMap):
    name = "ring"
    ring = True

    def __init__(self, mesh, pspecs, gspecs=None):
        super().__init__(mesh, pspecs, gspecs)
        _comm(self, ring=True)  # a hybrid mesh: its one-line error now, not at the first step


class Pmap(Strategy):
    name = "pmap"

    def __init__(self, mesh, pspecs, gspecs=None):
        super().__init__(mesh, pspecs, gspecs)
        if sharding.mesh_axes_used(pspecs) or sharding.mesh_axes_used(self.gspecs) or len(mesh.axis_names) > 1:
            raise ConfigError(f"{named('strategy', repr('pmap'))} keeps the whole state on every device of a 1-D mesh: "
                              f"use {named('strategy', repr('jit'))} (any sharding) or 'shard_map' / 'ring' (fsdp) for "
                              "sharded state or a 2-D mesh")
        self.devices = list(mesh.devices.flat)

    def _pmap(self, fn, plan, donate: bool) -> Pmapped:
        donate_argnums = (0,) if donate else ()
        pmapped = jax.pmap(fn, axis_name=DATA_AXIS, in_axes=(None, 0), out_axes=None, devices=self.devices,
                           donate_argnums=donate_argnums)
        return Pmapped(pmapped, plan.per_device, donate_argnums)

    def reduction(self, state_specs, per_device):
        return self._per_device(lambda fn: fn)  # the whole step runs inside the pmap (``compile``)

    def compile(self, step, plan):
        return self._pmap(step, plan, donate=True)  # the whole step, the update too, runs inside

    def evaluate(self, local_sums, plan, mspecs=P()):
        return self._pmap(lambda state, batch: lax.psum(local_sums(state.params, state.model_state, batch), DATA_AXIS),
                          plan, donate=False)


_CLASSES = {cls.name: cls for cls in (Jit, Explicit, ShardMap, Ring, Pmap)}


def make_strategy(name: str, mesh, pspecs, gspecs=None, model_axes: str = "auto") -> Strategy:
    """The strategy object for ``name``; ConfigError for an unknown name or a sharding it cannot run."""
    check_strategy(name, model_axes)
    if name == "explicit":
        return Explicit(mesh, pspecs, gspecs, model_axes)
    return _CLASSES[name](mesh, pspecs, gspecs)
