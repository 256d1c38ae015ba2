"""make_train_step / make_eval_step: pure, compiled, data-parallel steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import accumulate, parallel
from jaxtrain import precision as prec
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


def replicate(tree, sharding: NamedSharding):
    """Every leaf as a NEW global array replicated over ``sharding``'s mesh.

    Built from host values with ``make_array_from_callback``, so it works in
    multi-process runs (every process holds the same values) and never
    aliases the caller's arrays (``device_put`` may, and the step donates).
    """

    def put(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys: place their data
            return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def _is_global(batch) -> bool:
    return all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch))


def _checked_loss_output(out):
    """``out`` if it is ``(loss, (model_state, metrics))`` with a scalar loss and scalar metrics; else a ConfigError."""
    expected = "loss_fn must return (loss, (model_state, metrics)): a scalar loss and a dict of scalar metrics"
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple) and len(out[1]) == 2):
        raise ConfigError(f"{expected}; got {jax.tree.structure(out)}")
    loss, (_, metrics) = out
    if jnp.ndim(loss) != 0:
        raise ConfigError(f"{expected}; got a loss of shape {jnp.shape(loss)} (take the mean over the examples)")
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"{expected}; got metrics of type {type(metrics).__name__}")
    shaped = {k: jnp.shape(v) for k, v in metrics.items() if jnp.ndim(v) != 0}
    if shaped:
        raise ConfigError(f"{expected}; metrics {shaped} are not scalars (return their means over the examples)")
    return out


def _train_body(loss_fn: LossFn, tx: optax.GradientTransformation, policy: prec.Precision, accum_steps: int):
    def grad_fn(params, model_state, batch, rng, scale):
        """fp32 grads of the (scaled) loss, computed in the policy's compute dtype."""

        def scaled_loss(p):
            loss, (new_model_state, metrics) = _checked_loss_output(loss_fn(
                prec.cast_floats(p, policy.compute_dtype), model_state,
                prec.cast_floats(batch, policy.compute_dtype), rng))
            loss = loss.astype(policy.output_dtype)
            return loss * scale, (loss, new_model_state, metrics)

        (_, (loss, new_model_state, metrics)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        return grads, loss, new_model_state, metrics

    def body(state: TrainState, batch, comm: parallel.Comm):
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), comm.index())
        scale = prec.current_scale(state.loss_scale)
        params = comm.vary(state.params)  # grads stay per-device until the one reduction below
        if accum_steps > 1:
            one = lambda p, ms, b, r: grad_fn(p, ms, b, r, scale)  # noqa: E731
            grads, loss, model_state, metrics = comm.per_device(
                lambda p, b, r, vary: accumulate.scan_gradients(one, p, state.model_state, b, r, accum_steps, vary))(
                    params, batch, rng)
        else:
            grads, loss, model_state, metrics = grad_fn(params, state.model_state, batch, rng, scale)
        grads = prec.cast_floats(grads, policy.reduce_dtype)
        grads, loss, metrics, model_state = comm.mean((grads, loss, metrics, model_state))
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, **metrics}
        loss_scale = state.loss_scale
        if loss_scale is not None:
            # Non-finite on ANY device is non-finite after the reduction, everywhere.
            finite = prec.all_finite(grads)
            params = prec.select_tree(finite, params, state.params)
            opt_state = prec.select_tree(finite, opt_state, state.opt_state)
            loss_scale = prec.update_loss_scale(loss_scale, finite, policy)
            metrics.update(loss_scale=state.loss_scale["scale"], grads_finite=finite.astype(jnp.float32))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  model_state=model_state, loss_scale=loss_scale)
        return new_state, metrics

    return body


class Trainer:
    """A compiled data-parallel train step: ``state, metrics = trainer(state, batch)``."""

    def __init__(self, loss_fn: LossFn, tx: optax.GradientTransformation, mesh: Mesh, strategy: str,
                 precision: str | prec.Precision = "fp32", accum_steps: int = 1, accum: str = "scan"):
        parallel.check_strategy(strategy)
        accumulate.check(accum_steps, accum)
        self.policy = prec.get_policy(precision)
        self.loss_fn = loss_fn
        self.mesh, self.strategy, self.accum_steps, self.accum = mesh, strategy, accum_steps, accum
        self.tx = accumulate.wrap_optimizer(tx, accum_steps, accum)
        scan_steps = accum_steps if accum == "scan" else 1
        self.shard = _Sharder(mesh, divisor=scan_steps)
        body = _train_body(loss_fn, self.tx, self.policy, scan_steps)
        self._step = parallel.wrap(body, mesh, strategy, donate_state=True)

    @property
    def num_devices(self) -> int:
        return self.shard.num_devices

    def check_batch_size(self, size: int) -> None:
        self.shard.check_batch_size(size)

    def init(self, params, model_state=None, rng: jax.Array | None = None) -> TrainState:
        """A TrainState replicated over the mesh (fp32 params, fresh optimizer state)."""
        rng = jax.random.key(0) if rng is None else rng
        params = prec.cast_floats(params, self.policy.param_dtype)
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
            model_state={} if model_state is None else model_state,
            rng=rng,
            loss_scale=prec.init_loss_scale(self.policy),
        )
        return replicate(state, self.shard.replicated)

    def __call__(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        """One step on a global batch (numpy or jax arrays): checked and sharded first."""
        # A donated state's buffers are gone; reusing it segfaulted jaxlib 0.10.2 on 2+ CPU devices.
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
            raise ConfigError("this TrainState was donated to an earlier step and its buffers are gone: "
                              "pass the state the previous call returned (state, metrics = trainer(state, batch))")
        return self._step(state, self.shard(batch))

    def step(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        """One step on a batch ALREADY on the mesh (what ``prefetch_to_device`` yields).

        No checks, no copies: the hot-loop entry. Under
        ``jax.transfer_guard("disallow")`` a host array here is an error.
        """
        return self._step(state, batch)

    def lower(self, state: TrainState, batch: Mapping, platforms: tuple[str, ...] | None = None):
        """The lowered (not yet compiled) step for this state and batch.

        ``platforms``: lower for these instead of the mesh's devices, e.g.
        ``("cuda",)`` to check on a CPU host what a GPU would compile.
        """
        return self._step.lower(state, self.shard(batch), platforms)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh | int | None = None,
    strategy: str = "jit",
    precision: str | prec.Precision = "fp32",
    accum_steps: int = 1,
    accum: str = "scan",
) -> Trainer:
    """Build a data-parallel train step.

    ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``
    computes the mean loss over the examples it is given; ``metrics`` are
    scalar means. The trainer takes the GLOBAL batch (numpy or jax arrays);
    ``metrics["loss"]`` is the mean over the global batch.

    ``precision``: "fp32" | "bf16" | "fp16" (dynamic loss scale) or a
    ``jt.Precision``. ``accum_steps=k`` with ``accum="scan"``: each call splits
    every device's share into k micro-batches, one update per call;
    ``accum="multisteps"``: ``optax.MultiSteps``, one micro-batch per call and
    an update every k calls.
    """
    return Trainer(loss_fn, tx, make_mesh(mesh), strategy, precision, accum_steps, accum)


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

    def step(self, state: TrainState, batch: Mapping) -> dict:
        """The eval step on a batch already on the mesh (no checks, no copies)."""
        return self._step(state, batch)


def make_eval_step(eval_fn: EvalFn, *, mesh: Mesh | int | None = None, strategy: str = "jit") -> Evaluator:
    """Build an eval step from ``eval_fn(params, model_state, batch) -> {name: [B] values}``."""
    return Evaluator(eval_fn, make_mesh(mesh), strategy)
