"""make_train_step / make_eval_step: pure, compiled, data-parallel steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import parallel
from jaxtrain.devices import DATA_AXIS, make_mesh
from jaxtrain.errors import ConfigError
from jaxtrain.state import TrainState

LossFn = Callable  # (params, model_state, batch, rng) -> (loss, (model_state, metrics))
EvalFn = Callable  # (params, model_state, batch) -> {name: per-example values [B]}


class _Sharder:
    """Checks a global batch and places it on the mesh, sharded ``P("data")``."""

    def __init__(self, mesh: Mesh, divisor: int = 1):
        self.mesh = mesh
        self.divisor = divisor  # examples per device must divide by this (accumulation)
        self.replicated = NamedSharding(mesh, P())
        self.sharding = NamedSharding(mesh, P(DATA_AXIS))

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    def check_batch_size(self, size: int) -> None:
        """Raise ConfigError unless ``size`` splits evenly over the devices."""
        unit = self.num_devices * self.divisor
        if size < 1 or size % unit:
            what = f"{self.num_devices} devices" + (f" x {self.divisor} micro-batches" if self.divisor > 1 else "")
            lower, upper = max(unit, size // unit * unit), (size // unit + 1) * unit
            raise ConfigError(
                f"batch size {size} does not split evenly over {what}: use a multiple of {unit} (e.g. {lower} or {upper})"
            )

    def __call__(self, batch: Mapping) -> dict:
        sizes = {int(np.shape(x)[0]) for x in jax.tree.leaves(batch)}
        if len(sizes) != 1:
            raise ConfigError(f"every array in the batch needs the same leading (examples) axis, got sizes {sorted(sizes)}")
        local = sizes.pop()
        self.check_batch_size(local * (1 if _is_global(batch) else jax.process_count()))
        return jax.tree.map(self._put, batch)

    def _put(self, x):
        if isinstance(x, jax.Array):
            return x if x.sharding.is_equivalent_to(self.sharding, x.ndim) else jax.device_put(x, self.sharding)
        # This process's rows of the global batch (all of it in a 1-process run).
        return jax.make_array_from_process_local_data(self.sharding, np.asarray(x))


def _is_global(batch) -> bool:
    return all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch))


def _train_body(loss_fn: LossFn, tx: optax.GradientTransformation):
    def body(state: TrainState, batch, comm: parallel.Comm):
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), comm.index())
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, (model_state, metrics)), grads = grad_fn(comm.vary(state.params), state.model_state, batch, rng)
        grads, loss, metrics, model_state = comm.mean((grads, loss, metrics, model_state))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            model_state=model_state,
        )
        return new_state, {"loss": loss, **metrics}

    return body


class Trainer:
    """A compiled data-parallel train step: ``state, metrics = trainer(state, batch)``."""

    def __init__(self, loss_fn: LossFn, tx: optax.GradientTransformation, mesh: Mesh, strategy: str):
        parallel.check_strategy(strategy)
        self.tx, self.mesh, self.strategy = tx, mesh, strategy
        self.shard = _Sharder(mesh)
        self._step = parallel.wrap(_train_body(loss_fn, tx), mesh, strategy, donate_state=True)

    @property
    def num_devices(self) -> int:
        return self.shard.num_devices

    def check_batch_size(self, size: int) -> None:
        self.shard.check_batch_size(size)

    def init(self, params, model_state=None, rng: jax.Array | None = None) -> TrainState:
        """A TrainState replicated over the mesh (fp32 params, fresh optimizer state)."""
        rng = jax.random.key(0) if rng is None else rng
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
            model_state={} if model_state is None else model_state,
            rng=rng,
        )
        # The step donates the state, which must never delete the caller's own
        # arrays; device_put may alias them (even with may_alias=False, for the
        # first device's copy of a replicated array), so copy explicitly.
        state = jax.device_put(state, self.shard.replicated)
        return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)

    def __call__(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        return self._step(state, self.shard(batch))


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh | int | None = None,
    strategy: str = "jit",
) -> Trainer:
    """Build a data-parallel train step.

    ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``
    computes the mean loss over the examples it is given; ``metrics`` are
    scalar means. The trainer takes the GLOBAL batch (numpy or jax arrays);
    ``metrics["loss"]`` is the mean over the global batch.
    """
    mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
    return Trainer(loss_fn, tx, mesh, strategy)


def _eval_body(eval_fn: EvalFn):
    def body(state: TrainState, batch, comm: parallel.Comm):
        batch = dict(batch)
        mask = batch.pop("mask", None)
        per_example = eval_fn(state.params, state.model_state, batch)
        size = jax.tree.leaves(batch)[0].shape[0]
        mask = jnp.ones((size,), jnp.float32) if mask is None else mask.astype(jnp.float32)
        sums = {k: jnp.sum(v.astype(jnp.float32) * mask) for k, v in per_example.items()}
        sums["count"] = jnp.sum(mask)
        return comm.sum(sums)

    return body


class Evaluator:
    """A compiled eval step: ``sums = evaluator(state, batch)``.

    Returns the SUM of each per-example metric over the unmasked examples and
    ``count``, the number of them; divide to get means. A batch may carry a
    ``"mask"`` (1 = real example, 0 = padding) so that every example of a
    test set counts exactly once.
    """

    def __init__(self, eval_fn: EvalFn, mesh: Mesh, strategy: str):
        self.mesh, self.strategy = mesh, strategy
        self.shard = _Sharder(mesh)
        self._step = parallel.wrap(_eval_body(eval_fn), mesh, strategy, donate_state=False)

    def __call__(self, state: TrainState, batch: Mapping) -> dict:
        return self._step(state, self.shard(batch))


def make_eval_step(eval_fn: EvalFn, *, mesh: Mesh | int | None = None, strategy: str = "jit") -> Evaluator:
    """Build an eval step from ``eval_fn(params, model_state, batch) -> {name: [B] values}``."""
    mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
    return Evaluator(eval_fn, mesh, strategy)
