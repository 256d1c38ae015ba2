"""Parallel strategies: the step's per-shard half, wrapped four ways; each strategy one small object.

The step (``step.py``) hands a strategy ``local(params, model_state, loss_scale, batch, ctx) -> (grads,
loss, model_state, metrics)``: gradients and means over the examples it is given, NOT reduced across
devices. A strategy runs ``local`` on each shard of the batch with that shard's ``StepContext`` (its key,
its examples' rows, the axis its batch is split over), reduces what it returns across the ``"data"`` axis
with its own collectives (``Comm``), and compiles the whole step with the state's shardings
(``placement.py``):

- ``jit``: ``local`` sees the GLOBAL batch and XLA (GSPMD) inserts every
  collective, for any parameter sharding (FSDP, tensor parallelism). With
  micro-batch accumulation the scan runs per device (as under ``shard_map``)
  so that gradients are reduced once per update, not once per micro-batch.
- ``shard_map``: ``jax.shard_map`` over ``"data"``; explicit ``lax``
  collectives: FSDP parameters are all-gathered before use, their gradients
  reduce-scattered (``psum_scatter``) to the local shard; the rest ``pmean``.
- ``explicit``: ``jit`` with the shardings in the arrays' types (the mesh's
  axes Explicit, the step traced under ``jax.set_mesh``): the parameters are
  resharded to their gathered specs before the loss (FSDP's all-gather), the
  gradients to the update's specs after it (FSDP, ZeRO-1: each device's
  shard), with ``jax.sharding.reshard``. A model that knows no mesh runs
  under ``auto_axes`` (``model_axes="auto"``); ``model_axes="explicit"``
  hands it the typed arrays (its layers may ``reshard``).
- ``ring``: as ``shard_map``, with our ring collectives (``collectives.py``).
- ``pmap``: the legacy API, replicated state only; the update runs inside.

The optimizer update runs outside the per-device function on global arrays,
so an optimizer that looks across parameters (a global-norm clip) sees the
whole gradient under every sharding; element-wise ones stay shard-local.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.choices import MODEL_AXES, STRATEGIES
from jaxtrain.core import step as step_lib
from jaxtrain.core.state import keep_frozen, map_unfrozen
from jaxtrain.core.step import shard_context
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import sharding
from jaxtrain.parallel.collectives import Comm, make_comm
from jaxtrain.parallel.compiled import Compiled, Pmapped, UnderMesh
from jaxtrain.parallel.devices import DATA_AXIS, batch_axes


def check_strategy(strategy: str, model_axes: str = "auto") -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy={strategy!r}: use one of {', '.join(STRATEGIES)}")
    if model_axes not in MODEL_AXES:
        raise ConfigError(f"unknown model_axes={model_axes!r}: use one of {', '.join(MODEL_AXES)}")
    if model_axes == "explicit" and strategy != "explicit":
        raise ConfigError("model_axes='explicit' hands the model typed (Explicit) shardings, which only "
                          "strategy='explicit' has: use strategy='explicit', or model_axes='auto'")


def _comm(strategy, ring: bool = False) -> Comm:
    return make_comm(sharding.data_dims(strategy.pspecs), ring=ring, grad_dims=sharding.data_dims(strategy.gspecs),
                     batch=batch_axes(strategy.mesh), shard=sharding.fsdp_axes((strategy.pspecs, strategy.gspecs)))


def _per_device(local: Callable, comm: Comm, mesh, state_dims=None) -> Callable:
    """(params, model_state, loss_scale, batch, step_key) -> reduced (grads, loss, model_state, metrics), per
    device. ``state_dims``: per model-state leaf, its FSDP dimension (Frozen parts placed like params) or None."""

    axes = batch_axes(mesh)

    def run(params, model_state, loss_scale, batch, step_key):
        d = lax.axis_index(axes)  # on a hybrid mesh: replica-major, as the batch is split
        ctx = shard_context(step_key, batch, mesh, d, axes, comm.vary)
        whole_state = model_state if state_dims is None else comm.gather_like(model_state, state_dims)
        grads, loss, new_state, metrics = local(comm.gather(params), whole_state, loss_scale, batch, ctx)
        loss, metrics = comm.mean((loss, metrics))
        return comm.scatter_mean(grads), loss, map_unfrozen(comm.mean, keep_frozen(new_state, model_state)), metrics

    return run


class Strategy:
    """One strategy's collectives and wrapping over ``mesh``, for the parameter specs ``pspecs`` and the specs
    ``gspecs`` of the gradients it hands the update (the optimizer state's: ZeRO-1's differ from ``pspecs``).

    ``reduced(local, state_specs, per_device)``: ``local`` on every shard, reduced over the shards;
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

    def reduced(self, local: Callable, state_specs, per_device: bool) -> Callable:
        raise NotImplementedError

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

    def reduced(self, local, state_specs, per_device):
        mspecs = state_specs.model_state
        if per_device:  # left to GSPMD, every micro-batch's gradient would be reduced (k times the bytes)
            return self._manual(_per_device(local, _comm(self), self.mesh, sharding.data_dims(mspecs)),
                                (self.pspecs, mspecs, P(), P(batch_axes(self.mesh)), P()),
                                (self.gspecs, P(), mspecs, P()))
        grad_shardings = sharding.named(self.mesh, self.gspecs)
        gathered, gathered_state = self._whole(self.pspecs), self._whole(mspecs)

        def reduced(params, model_state, loss_scale, batch, step_key):
            params = self._constrain(params, gathered)
            model_state = self._constrain(model_state, gathered_state)  # an FSDP teacher: gathered
            ctx = shard_context(step_key, batch, self.mesh)
            grads, *rest = local(params, model_state, loss_scale, batch, ctx)
            # Gathered params at the loss, grads sharded like their params: without the first constraint GSPMD
            # gathered activations instead. (XLA:CPU still reduces FSDP grads as all-reduce + slice: docs/sharding.md.)
            return self._constrain(grads, grad_shardings), *rest

        return reduced

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
        return step_lib.auto_axes(fn) if self.model_axes == "auto" else fn

    def _constrain(self, tree, shardings):
        return jax.sharding.reshard(tree, shardings)

    def reduced(self, local, state_specs, per_device):
        inner = super().reduced(local, state_specs, per_device)
        others = tuple(a for a in self.mesh.axis_names if a not in sharding.BATCH_AXES)
        if not (per_device and others):
            return inner
        # Accumulation runs per device (shard_map over "data"); jax's psum_scatter cannot type a gradient that is
        # also Explicit over "model" there, so the other axes turn Auto around it, their placement restored after.
        out = (self.gspecs, P(), state_specs.model_state, P())
        return jax.sharding.auto_axes(inner, axes=others, out_sharding=out)

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
            raise ConfigError(f"strategy={self.name!r} shards parameters over {DATA_AXIS!r} only (fsdp), but the rules "
                              f"name {', '.join(map(repr, other))}: use strategy='jit' for tensor parallelism")

    def _map(self, fn, in_specs, out_specs):
        # ppermute results are typed "varying" even when all devices hold the
        # same values, so the ring's outputs cannot be checked as P().
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=not self.ring)

    def reduced(self, local, state_specs, per_device):
        mspecs = state_specs.model_state
        return self._map(_per_device(local, _comm(self, self.ring), self.mesh, sharding.data_dims(mspecs)),
                         (self.pspecs, mspecs, P(), P(batch_axes(self.mesh)), P()),
                         (self.gspecs, P(), mspecs, P()))

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
            raise ConfigError("strategy='pmap' keeps the whole state on every device of a 1-D mesh: use strategy='jit' "
                              "(any sharding) or 'shard_map' / 'ring' (fsdp) for sharded state or a 2-D mesh")
        self.devices = list(mesh.devices.flat)

    def _pmap(self, fn, plan, donate: bool) -> Pmapped:
        donate_argnums = (0,) if donate else ()
        pmapped = jax.pmap(fn, axis_name=DATA_AXIS, in_axes=(None, 0), out_axes=None, devices=self.devices,
                           donate_argnums=donate_argnums)
        return Pmapped(pmapped, plan.per_device, donate_argnums)

    def reduced(self, local, state_specs, per_device):
        return _per_device(local, _comm(self), self.mesh)

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
