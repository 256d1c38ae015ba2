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

from jaxtrain import sharding
from jaxtrain.choices import STRATEGIES
from jaxtrain.collectives import Comm, make_comm
from jaxtrain.devices import DATA_AXIS
from jaxtrain.errors import ConfigError
from jaxtrain.state import keep_frozen, map_unfrozen
from jaxtrain.step import StepContext, local_rows


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy={strategy!r}: use one of {', '.join(STRATEGIES)}")


def _comm(strategy, ring: bool = False) -> Comm:
    return make_comm(sharding.data_dims(strategy.pspecs), ring=ring, grad_dims=sharding.data_dims(strategy.gspecs))


def _per_device(local: Callable, comm: Comm, mesh, state_dims=None) -> Callable:
    """(params, model_state, loss_scale, batch, step_key) -> reduced (grads, loss, model_state, metrics), per
    device. ``state_dims``: per model-state leaf, its FSDP dimension (Frozen parts placed like params) or None."""

    def run(params, model_state, loss_scale, batch, step_key):
        d = lax.axis_index(DATA_AXIS)
        ctx = StepContext(key=jax.random.fold_in(step_key, d), step_key=step_key, batch_axis=DATA_AXIS, mesh=mesh,
                          rows=local_rows(batch, d * jax.tree.leaves(batch)[0].shape[0]), vary=comm.vary)
        whole_state = model_state if state_dims is None else comm.gather_like(model_state, state_dims)
        grads, loss, new_state, metrics = local(comm.gather(params), whole_state, loss_scale, batch, ctx)
        loss, metrics = comm.mean((loss, metrics))
        return comm.scatter_mean(grads), loss, map_unfrozen(comm.mean, keep_frozen(new_state, model_state)), metrics

    return run


class Compiled:
    """A wrapped step: call it, or ``lower(state, batch, platforms)`` it (e.g. ``("cuda",)`` on a CPU host)."""

    def __init__(self, jitted, prepare=lambda batch: batch):
        self._jitted, self._prepare = jitted, prepare

    def __call__(self, state, batch):
        return self._jitted(state, self._prepare(batch))

    def lower(self, state, batch, platforms: tuple[str, ...] | None = None):
        return self._jitted.trace(state, self._prepare(batch)).lower(lowering_platforms=platforms)


class _Pmapped(Compiled):
    """``jax.pmap``'s own ``lower`` takes neither platforms nor shapes: those lower the same pmap under a jit."""

    def __init__(self, pmapped, prepare, donate):
        super().__init__(pmapped, prepare)
        self._under_jit = jax.jit(lambda state, batch: pmapped(state, prepare(batch)), donate_argnums=donate)

    def lower(self, state, batch, platforms: tuple[str, ...] | None = None):
        if platforms is None and not sharding.is_abstract(batch):
            return self._jitted.lower(state, self._prepare(batch))
        return self._under_jit.trace(state, batch).lower(lowering_platforms=platforms)


class Strategy:
    """One strategy's collectives and wrapping over ``mesh``, for the parameter specs ``pspecs`` and the specs
    ``gspecs`` of the gradients it hands the update (the optimizer state's: ZeRO-1's differ from ``pspecs``).

    ``reduced(local, state_specs, per_device)``: ``local`` on every shard, reduced over the shards;
    ``compile(step, plan)``: the whole step, compiled with the plan's shardings (the state donated);
    ``evaluate(sums, plan, mspecs)``: an eval step's sums over every device's examples."""

    name = ""

    def __init__(self, mesh, pspecs, gspecs=None):
        self.mesh, self.pspecs = mesh, pspecs
        self.gspecs = pspecs if gspecs is None else gspecs

    def reduced(self, local: Callable, state_specs, per_device: bool) -> Callable:
        raise NotImplementedError

    def compile(self, step: Callable, plan) -> Compiled:
        """``step(state, batch)`` over global arrays, the state donated and kept in its shardings."""
        return Compiled(jax.jit(step, in_shardings=(plan.state, plan.batch), out_shardings=(plan.state, plan.replicated),
                                donate_argnums=(0,)))

    def evaluate(self, local_sums: Callable, plan, mspecs=P()) -> Compiled:
        """``local_sums(params, model_state, batch) -> sums`` over the examples given, summed over the devices;
        ``mspecs``: how the model state is placed (Frozen parts may be sharded like the params)."""
        raise NotImplementedError


class Jit(Strategy):
    name = "jit"

    def _manual(self, fn, in_specs, out_specs):
        """``fn`` per device along "data" only; other mesh axes stay with GSPMD (tensor parallelism)."""
        only_data = lambda specs: jax.tree.map(sharding.data_only, specs, is_leaf=sharding.is_spec)  # noqa: E731
        manual = frozenset({DATA_AXIS}) if len(self.mesh.axis_names) > 1 else frozenset()
        return jax.shard_map(fn, mesh=self.mesh, in_specs=only_data(in_specs), out_specs=only_data(out_specs),
                             axis_names=manual)

    def reduced(self, local, state_specs, per_device):
        mspecs = state_specs.model_state
        if per_device:  # left to GSPMD, every micro-batch's gradient would be reduced (k times the bytes)
            return self._manual(_per_device(local, _comm(self), self.mesh, sharding.data_dims(mspecs)),
                                (self.pspecs, mspecs, P(), P(DATA_AXIS), P()), (self.gspecs, P(), mspecs, P()))
        grad_shardings = sharding.named(self.mesh, self.gspecs)
        whole = lambda specs: sharding.named(  # noqa: E731
            self.mesh, jax.tree.map(sharding.without_data, specs, is_leaf=sharding.is_spec))
        gathered, gathered_state = whole(self.pspecs), whole(mspecs)

        def reduced(params, model_state, loss_scale, batch, step_key):
            params = lax.with_sharding_constraint(params, gathered)
            model_state = lax.with_sharding_constraint(model_state, gathered_state)  # an FSDP teacher: gathered
            ctx = StepContext(key=jax.random.fold_in(step_key, 0), step_key=step_key, rows=local_rows(batch),
                              batch_axis=None, mesh=self.mesh)
            grads, *rest = local(params, model_state, loss_scale, batch, ctx)
            # Gathered params at the loss, grads sharded like their params: without the first constraint GSPMD
            # gathered activations instead. (XLA:CPU still reduces FSDP grads as all-reduce + slice: docs/sharding.md.)
            return lax.with_sharding_constraint(grads, grad_shardings), *rest

        return reduced

    def evaluate(self, local_sums, plan, mspecs=P()):
        return Compiled(jax.jit(lambda state, batch: local_sums(state.params, state.model_state, batch),
                                out_shardings=plan.replicated))


class ShardMap(Strategy):
    name = "shard_map"
    ring = False

    def __init__(self, mesh, pspecs, gspecs=None):
        super().__init__(mesh, pspecs, gspecs)
        other = sorted((sharding.mesh_axes_used(pspecs) | sharding.mesh_axes_used(self.gspecs)) - {DATA_AXIS})
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
                         (self.pspecs, mspecs, P(), P(DATA_AXIS), P()), (self.gspecs, P(), mspecs, P()))

    def evaluate(self, local_sums, plan, mspecs=P()):
        comm = make_comm(sharding.data_dims(self.pspecs), ring=self.ring)
        state_dims = sharding.data_dims(mspecs)

        def run(params, model_state, batch):
            whole_state = model_state if state_dims is None else comm.gather_like(model_state, state_dims)
            return comm.sum(local_sums(comm.gather(params), whole_state, batch))

        mapped = self._map(run, (self.pspecs, mspecs, P(DATA_AXIS)), P())
        return Compiled(jax.jit(lambda state, batch: mapped(state.params, state.model_state, batch)))


class Ring(ShardMap):
    name = "ring"
    ring = True


class Pmap(Strategy):
    name = "pmap"

    def __init__(self, mesh, pspecs, gspecs=None):
        super().__init__(mesh, pspecs, gspecs)
        if sharding.mesh_axes_used(pspecs) or sharding.mesh_axes_used(self.gspecs) or len(mesh.axis_names) > 1:
            raise ConfigError("strategy='pmap' keeps the whole state on every device of a 1-D mesh: use strategy='jit' "
                              "(any sharding) or 'shard_map' / 'ring' (fsdp) for sharded state or a 2-D mesh")
        self.devices = list(mesh.devices.flat)

    def _pmap(self, fn, donate: bool) -> _Pmapped:
        n = len(self.devices)
        donate_argnums = (0,) if donate else ()
        pmapped = jax.pmap(fn, axis_name=DATA_AXIS, in_axes=(None, 0), out_axes=None, devices=self.devices,
                           donate_argnums=donate_argnums)

        def per_device(batch):  # users never reshape to [devices, per_device, ...]
            return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

        return _Pmapped(pmapped, per_device, donate_argnums)

    def reduced(self, local, state_specs, per_device):
        return _per_device(local, _comm(self), self.mesh)

    def compile(self, step, plan):
        return self._pmap(step, donate=True)  # the whole step, the update too, runs inside

    def evaluate(self, local_sums, plan, mspecs=P()):
        psum = lambda t: lax.psum(t, DATA_AXIS)  # noqa: E731
        return self._pmap(lambda state, batch: psum(local_sums(state.params, state.model_state, batch)), donate=False)


_CLASSES = {cls.name: cls for cls in (Jit, ShardMap, Ring, Pmap)}


def make_strategy(name: str, mesh, pspecs, gspecs=None) -> Strategy:
    """The strategy object for ``name``; ConfigError for an unknown name or a sharding it cannot run."""
    check_strategy(name)
    return _CLASSES[name](mesh, pspecs, gspecs)
