"""Parallel strategies: one per-shard computation, wrapped four ways; each strategy one small object.

The step (``step.py``) hands a strategy two functions:

- ``local(params, model_state, loss_scale, batch, rng, vary, step_key, rows) -> (grads, loss, model_state,
  metrics)``: gradients and means over the examples it is given, NOT reduced
  across devices (``vary`` marks fresh zeros per-device, for the micro-batch
  scan; ``step_key`` and ``rows``, the examples' global rows, for jt.dropout);
- ``update(state, grads, loss, model_state, metrics) -> (state, metrics)``:
  the optimizer step on global arrays, after the reduction.

A strategy runs ``local`` on each device's share of the batch, reduces what
it returns across the ``"data"`` axis with its own collectives (``Comm``),
and places the state with the shardings of ``sharding.py``:

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

import contextlib
import contextvars
from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import rng as random_rule
from jaxtrain import sharding
from jaxtrain.choices import STRATEGIES
from jaxtrain.collectives import Comm, make_comm
from jaxtrain.devices import DATA_AXIS
from jaxtrain.errors import ConfigError
from jaxtrain.state import keep_frozen, map_unfrozen

_BATCH_AXIS = contextvars.ContextVar("jaxtrain_batch_axis", default=None)


def batch_axis() -> str | None:
    """The mesh axis the batch is split over inside the step being traced; None where it sees the global batch.

    Models pass it to their batch statistics (``nn.BatchNorm(axis_name=jt.batch_axis())``)
    so that BatchNorm averages over the global batch under every strategy,
    without being told the strategy.
    """
    return _BATCH_AXIS.get()


@contextlib.contextmanager
def _split_over(axis: str):
    token = _BATCH_AXIS.set(axis)
    try:
        yield
    finally:
        _BATCH_AXIS.reset(token)


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")


def _per_device(local: Callable, comm: Comm, state_dims=None) -> Callable:
    """(params, model_state, loss_scale, batch, base_rng) -> reduced (grads, loss, model_state, metrics), per device.
    ``state_dims``: per model-state leaf, its FSDP dimension (Frozen parts placed like params) or None."""

    def run(params, model_state, loss_scale, batch, step_key):
        d = lax.axis_index(DATA_AXIS)
        rows = random_rule.local_rows(batch, d * jax.tree.leaves(batch)[0].shape[0])  # this shard's global rows
        whole_state = model_state if state_dims is None else comm.gather_like(model_state, state_dims)
        with _split_over(DATA_AXIS):
            grads, loss, new_state, metrics = local(comm.gather(params), whole_state, loss_scale, batch,
                                                    jax.random.fold_in(step_key, d), comm.vary, step_key, rows)
        loss, metrics = comm.mean((loss, metrics))
        return comm.scatter_mean(grads), loss, map_unfrozen(comm.mean, keep_frozen(new_state, model_state)), metrics

    return run


def _step_with(update: Callable, reduced: Callable) -> Callable:
    """state, batch -> update(state, *reduced(...)): the key folds in the step (and, per device, its index:
    the rule in jaxtrain/rng.py)."""

    def step(state, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        return update(state, *reduced(state.params, state.model_state, state.loss_scale, batch, rng))

    return step


class Compiled:
    """A wrapped step: call it, or ``lower(state, batch, platforms)`` it (e.g. ``("cuda",)`` on a CPU host)."""

    def __init__(self, jitted, prepare=lambda batch: batch):
        self._jitted, self._prepare = jitted, prepare

    def __call__(self, state, batch):
        return self._jitted(state, self._prepare(batch))

    def lower(self, state, batch, platforms: tuple[str, ...] | None = None):
        return self._jitted.trace(state, self._prepare(batch)).lower(lowering_platforms=platforms)


class _Pmapped(Compiled):
    """``jax.pmap``'s own ``lower`` takes no platforms: other platforms lower the same pmap under a jit."""

    def __init__(self, pmapped, prepare, donate):
        super().__init__(pmapped, prepare)
        self._under_jit = jax.jit(lambda state, batch: pmapped(state, prepare(batch)), donate_argnums=donate)

    def lower(self, state, batch, platforms: tuple[str, ...] | None = None):
        if platforms is None:
            return self._jitted.lower(state, self._prepare(batch))
        return self._under_jit.trace(state, batch).lower(lowering_platforms=platforms)


class Strategy:
    """Owns one strategy's collectives, wrapping and shardings over ``mesh`` for the parameter specs ``pspecs``."""

    name = ""

    def __init__(self, mesh, pspecs):
        self.mesh, self.pspecs = mesh, pspecs
        self.replicated = NamedSharding(mesh, P())
        self.batch = NamedSharding(mesh, P(DATA_AXIS))

    def _jit(self, fn, state_specs):
        """The train step over global arrays, the state donated and kept in its shardings. It traces under its
        mesh, so code inside can see the mesh (the Pallas kernels split their rows over "data" with it)."""
        state = sharding.named(self.mesh, state_specs)

        def under_mesh(*args):
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                return fn(*args)

        return Compiled(jax.jit(under_mesh, in_shardings=(state, self.batch), out_shardings=(state, self.replicated),
                                 donate_argnums=(0,)))

    def train(self, local: Callable, update: Callable, state_specs, per_device: bool) -> Compiled:
        """The compiled, donated train step."""
        raise NotImplementedError

    def evaluate(self, local_sums: Callable, mspecs=P()) -> Compiled:
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

    def train(self, local, update, state_specs, per_device):
        mspecs = state_specs.model_state
        if per_device:  # left to GSPMD, every micro-batch's gradient would be reduced (k times the bytes)
            comm = make_comm(sharding.data_dims(self.pspecs))
            reduced = self._manual(_per_device(local, comm, sharding.data_dims(mspecs)),
                                   (self.pspecs, mspecs, P(), P(DATA_AXIS), P()), (self.pspecs, P(), mspecs, P()))
        else:
            grad_shardings = sharding.named(self.mesh, self.pspecs)
            whole = lambda specs: sharding.named(  # noqa: E731
                self.mesh, jax.tree.map(sharding.without_data, specs, is_leaf=sharding.is_spec))
            gathered, gathered_state = whole(self.pspecs), whole(mspecs)

            def reduced(params, model_state, loss_scale, batch, rng):
                params = lax.with_sharding_constraint(params, gathered)
                model_state = lax.with_sharding_constraint(model_state, gathered_state)  # an FSDP teacher: gathered
                grads, *rest = local(params, model_state, loss_scale, batch, jax.random.fold_in(rng, 0), lambda t: t,
                                     rng, random_rule.local_rows(batch))
                # Gathered params at the loss, grads sharded like their params: without the first constraint GSPMD
                # gathered activations instead. (XLA:CPU still reduces FSDP grads as all-reduce + slice: README.)
                return lax.with_sharding_constraint(grads, grad_shardings), *rest

        return self._jit(_step_with(update, reduced), state_specs)

    def evaluate(self, local_sums, mspecs=P()):
        return Compiled(jax.jit(lambda state, batch: local_sums(state.params, state.model_state, batch),
                                 out_shardings=self.replicated))


class ShardMap(Strategy):
    name = "shard_map"
    ring = False

    def __init__(self, mesh, pspecs):
        super().__init__(mesh, pspecs)
        other = sorted(sharding.mesh_axes_used(pspecs) - {DATA_AXIS})
        if other:
            raise ConfigError(f"strategy {self.name!r} shards parameters over {DATA_AXIS!r} only (fsdp), but the rules "
                              f"name {', '.join(map(repr, other))}: use strategy='jit' for tensor parallelism")

    def _map(self, fn, in_specs, out_specs):
        # ppermute results are typed "varying" even when all devices hold the
        # same values, so the ring's outputs cannot be checked as P().
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=not self.ring)

    def train(self, local, update, state_specs, per_device):
        comm, mspecs = make_comm(sharding.data_dims(self.pspecs), ring=self.ring), state_specs.model_state
        reduced = self._map(_per_device(local, comm, sharding.data_dims(mspecs)),
                            (self.pspecs, mspecs, P(), P(DATA_AXIS), P()), (self.pspecs, P(), mspecs, P()))
        return self._jit(_step_with(update, reduced), state_specs)

    def evaluate(self, local_sums, mspecs=P()):
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

    def __init__(self, mesh, pspecs):
        super().__init__(mesh, pspecs)
        if sharding.mesh_axes_used(pspecs) or len(mesh.axis_names) > 1:
            raise ConfigError("strategy 'pmap' keeps the whole state on every device of a 1-D mesh: use strategy='jit' "
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

    def train(self, local, update, state_specs, per_device):
        reduced = _per_device(local, make_comm(sharding.data_dims(self.pspecs)))
        return self._pmap(_step_with(update, reduced), donate=True)

    def evaluate(self, local_sums, mspecs=P()):
        psum = lambda t: lax.psum(t, DATA_AXIS)  # noqa: E731
        return self._pmap(lambda state, batch: psum(local_sums(state.params, state.model_state, batch)), donate=False)


_CLASSES = {cls.name: cls for cls in (Jit, ShardMap, Ring, Pmap)}


def make_strategy(name: str, mesh, pspecs) -> Strategy:
    """The strategy object for ``name``; ConfigError for an unknown name or a sharding it cannot run."""
    check_strategy(name)
    return _CLASSES[name](mesh, pspecs)
