"""make_train_step / make_eval_step: pure, compiled, data-parallel steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import accumulate, optim, parallel, sharding
from jaxtrain import precision as prec
from jaxtrain import rng as random_rule
from jaxtrain.devices import make_mesh
from jaxtrain.errors import ConfigError
from jaxtrain.state import TrainState, keep_frozen

LossFn = Callable  # (params, model_state, batch, rng) -> (loss, (model_state, metrics))
EvalFn = Callable  # (params, model_state, batch) -> {name: per-example values [B]}


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


def _train_fns(loss_fn: LossFn, tx: optax.GradientTransformation, policy: prec.Precision, accum_steps: int):
    """(local, update): the two halves of the step a strategy wraps (see parallel.py)."""

    def grad_fn(params, model_state, batch, rng, scale, step_key, rows):
        """fp32 grads of the (scaled) loss, computed in the policy's compute dtype."""

        def scaled_loss(p):
            with random_rule.examples(step_key, rows):  # for jt.dropout: the step's key, the examples' rows
                loss, (new_model_state, metrics) = _checked_loss_output(loss_fn(
                    prec.cast_floats(p, policy.compute_dtype), model_state,
                    prec.cast_floats(batch, policy.compute_dtype), rng))
            loss = loss.astype(policy.output_dtype)
            return loss * scale, (loss, new_model_state, metrics)

        (_, (loss, new_model_state, metrics)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        return grads, loss, new_model_state, metrics

    def local(params, model_state, loss_scale, batch, rng, vary, step_key, rows):
        """Gradients and means over the examples given (a device's share, or all under "jit"), not reduced.

        ``rows``: the examples' rows in the update's whole batch (jaxtrain.rng)."""
        scale = prec.current_scale(loss_scale)
        if accum_steps > 1:  # the rows split into micro-batches with the examples
            one = lambda p, ms, b, r: grad_fn(p, ms, b[0], r, scale, step_key, b[1])  # noqa: E731
            grads, loss, model_state, metrics = accumulate.scan_gradients(one, params, model_state, (batch, rows),
                                                                         rng, accum_steps, vary)
        else:
            grads, loss, model_state, metrics = grad_fn(params, model_state, batch, rng, scale, step_key, rows)
        return prec.cast_floats(grads, policy.reduce_dtype), loss, model_state, metrics

    def update(state: TrainState, grads, loss, model_state, metrics):
        scale = prec.current_scale(state.loss_scale)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, **metrics}
        lr = optim.learning_rate(opt_state)  # what this update used, where the optimizer records it (jt.optim)
        if lr is not None:
            metrics["lr"] = lr
        loss_scale = state.loss_scale
        if loss_scale is not None:
            # Non-finite on ANY device is non-finite after the reduction, everywhere.
            finite = prec.all_finite(grads)
            params = prec.select_tree(finite, params, state.params)
            opt_state = prec.select_tree(finite, opt_state, state.opt_state)
            loss_scale = prec.update_loss_scale(loss_scale, finite, policy)
            metrics.update(loss_scale=state.loss_scale["scale"], grads_finite=finite.astype(jnp.float32))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  model_state=keep_frozen(model_state, state.model_state), loss_scale=loss_scale)
        return new_state, metrics

    return local, update


def _check_not_donated(state) -> None:
    """A donated state's buffers are gone; reusing it segfaulted jaxlib 0.10.2 on 2+ CPU devices."""
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise ConfigError("this TrainState was donated to an earlier step and its buffers are gone: "
                          "pass the state the previous call returned (state, metrics = trainer(state, batch))")


class Trainer:
    """A compiled train step: ``state, metrics = trainer(state, batch)``; the state placed by ``param_sharding``."""

    pipeline_layout: dict | None = None  # how a pipelined trainer stores its layers (checkpoints must match)

    def __init__(self, loss_fn: LossFn, tx: optax.GradientTransformation, mesh: Mesh, strategy: str,
                 precision: str | prec.Precision = "fp32", accum_steps: int = 1, accum: str = "scan",
                 param_sharding="replicated", min_size: int = sharding.MIN_SIZE):
        parallel.check_strategy(strategy)
        accumulate.check(accum_steps, accum)
        sharding.param_specs({}, param_sharding, mesh)  # malformed rules: an error now, not at init
        self.policy = prec.get_policy(precision)
        self.loss_fn = loss_fn
        self.mesh, self.strategy, self.accum_steps, self.accum = mesh, strategy, accum_steps, accum
        self.param_sharding, self.min_size = param_sharding, min_size
        self.tx = accumulate.wrap_optimizer(tx, accum_steps, accum)
        self.scan_steps = accum_steps if accum == "scan" else 1
        self.shard = sharding.BatchSharder(mesh, divisor=self.scan_steps)
        self._local, self._update = _train_fns(loss_fn, self.tx, self.policy, self.scan_steps)
        self._steps = {}  # state tree structure -> compiled step

    @property
    def num_devices(self) -> int:
        return self.shard.num_devices

    def check_batch_size(self, size: int) -> None:
        self.shard.check_batch_size(size)

    def state_specs(self, state) -> TrainState:
        """A PartitionSpec per leaf of ``state`` (arrays or shapes): parameters, and Frozen model state (a
        distillation teacher), by ``param_sharding``."""
        specs = lambda tree: sharding.param_specs(tree, self.param_sharding, self.mesh, self.min_size)  # noqa: E731
        return sharding.state_specs(state, specs(state.params), self.tx, frozen_specs=specs)

    def plan(self, params) -> dict:
        """Where each parameter goes (``params``: arrays or shapes): ``{"sharded": {name: spec}, "replicated": [...]}``.

        A ConfigError, before anything compiles, if a rule does not fit these
        parameters or this strategy cannot run the sharding.
        """
        pspecs = sharding.param_specs(params, self.param_sharding, self.mesh, self.min_size)
        parallel.make_strategy(self.strategy, self.mesh, pspecs)
        return sharding.describe(params, pspecs)

    def _fresh(self, params, model_state, rng) -> TrainState:
        params = prec.cast_floats(params, self.policy.param_dtype)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                          model_state={} if model_state is None else model_state, rng=rng,
                          loss_scale=prec.init_loss_scale(self.policy))

    def init(self, params=None, model_state=None, rng: jax.Array | None = None, *, init_fn=None) -> TrainState:
        """A TrainState on the mesh (fp32 params, fresh optimizer state), each leaf with its sharding.

        ``init_fn(rng) -> (params, model_state)`` instead of ``params``: run
        compiled with the state's shardings, so the whole state never exists
        on one device (``init(init_fn=f, rng=k)`` equals ``init(*jax.jit(f)(k), rng=k)``).
        """
        if (params is None) == (init_fn is None):
            raise ConfigError("trainer.init takes params (and model_state) or init_fn=f with f(rng) -> "
                              "(params, model_state): one of the two")
        rng = jax.random.key(0) if rng is None else rng
        make = (lambda r: self._fresh(*init_fn(r), r)) if init_fn else (lambda r: self._fresh(params, model_state, r))
        specs = self.state_specs(jax.eval_shape(make, rng))
        parallel.make_strategy(self.strategy, self.mesh, specs.params)  # a sharding it cannot run: an error now
        shardings = sharding.named(self.mesh, specs)
        if init_fn is None:
            return sharding.place(self._fresh(params, model_state, rng), shardings)
        return jax.jit(make, out_shardings=shardings)(sharding.place(rng, self.shard.replicated))

    def _compiled(self, state) -> parallel.Compiled:
        key = jax.tree.structure(state)
        if key not in self._steps:
            specs = self.state_specs(state)
            strategy = parallel.make_strategy(self.strategy, self.mesh, specs.params)
            self._steps[key] = strategy.train(self._local, self._update, specs, per_device=self.scan_steps > 1)
        return self._steps[key]

    def __call__(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        """One step on a global batch (numpy or jax arrays): checked and sharded first."""
        _check_not_donated(state)
        return self._compiled(state)(state, self.shard(batch))

    def step(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        """One step on a batch ALREADY on the mesh (what ``prefetch_to_device`` yields).

        No checks, no copies: the hot-loop entry. Under
        ``jax.transfer_guard("disallow")`` a host array here is an error.
        """
        return self._compiled(state)(state, batch)

    def lower(self, state: TrainState, batch: Mapping, platforms: tuple[str, ...] | None = None):
        """The lowered (not yet compiled) step for this state and batch.

        ``platforms``: lower for these instead of the mesh's devices, e.g.
        ``("cuda",)`` to check on a CPU host what a GPU would compile.
        """
        return self._compiled(state).lower(state, self.shard(batch), platforms)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    mesh: Mesh | int | None = None,
    strategy: str = "jit",
    precision: str | prec.Precision = "fp32",
    accum_steps: int = 1,
    accum: str = "scan",
    param_sharding="replicated",
    min_size: int = sharding.MIN_SIZE,
) -> Trainer:
    """Build a (data-parallel, optionally sharded-state) train step.

    ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``
    computes the mean loss over the examples it is given; ``metrics`` are
    scalar means. The trainer takes the GLOBAL batch (numpy or jax arrays);
    ``metrics["loss"]`` is the mean over the global batch.

    ``precision``: "fp32" | "bf16" | "fp16" (dynamic loss scale) or a
    ``jt.Precision``. ``accum_steps=k`` with ``accum="scan"``: each call splits
    every device's share into k micro-batches, one update per call;
    ``accum="multisteps"``: ``optax.MultiSteps``, one micro-batch per call and
    an update every k calls.

    ``param_sharding``: "replicated" (data parallelism), "fsdp" (every
    parameter of at least ``min_size`` elements, and its optimizer state,
    sharded over "data" along its largest dimension that divides), or rules
    ``[(regex, PartitionSpec | "fsdp" | jt.FSDP(spec) | "replicated"), ...]``
    on the "/"-joined parameter path (first match wins; unmatched =
    replicated): tensor parallelism and FSDP x TP on a 2-D mesh (``jit``).
    """
    return Trainer(loss_fn, tx, make_mesh(mesh), strategy, precision, accum_steps, accum, param_sharding, min_size)


def _eval_sums(eval_fn: EvalFn):
    def local_sums(params, model_state, batch):
        batch = dict(batch)
        mask = batch.pop("mask", None)
        per_example = eval_fn(params, model_state, batch)
        size = jax.tree.leaves(batch)[0].shape[0]
        mask = jnp.ones((size,), jnp.float32) if mask is None else mask.astype(jnp.float32)
        sums = {k: jnp.sum(v.astype(jnp.float32) * mask) for k, v in per_example.items()}
        sums["count"] = jnp.sum(mask)
        return sums

    return local_sums


def _specs_of(tree):
    """The PartitionSpec each leaf is placed with (P() for what is not on a named mesh)."""
    return jax.tree.map(lambda x: x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P(),
                        tree)


class Evaluator:
    """A compiled eval step: ``sums = evaluator(state, batch)``.

    Returns the SUM of each per-example metric over the unmasked examples and
    ``count``, the number of them; divide to get means. A batch may carry a
    ``"mask"`` (1 = real example, 0 = padding) so that every example of a
    test set counts exactly once. The state may be sharded any way the
    strategy supports (its placement is read from the state).
    """

    def __init__(self, eval_fn: EvalFn, mesh: Mesh, strategy: str):
        parallel.check_strategy(strategy)
        self.mesh, self.strategy = mesh, strategy
        self.shard = sharding.BatchSharder(mesh)
        self._sums = _eval_sums(eval_fn)
        self._steps = {}  # (tree structure, param specs) -> compiled

    def _compiled(self, state):
        pspecs, mspecs = _specs_of(state.params), _specs_of(state.model_state)
        key = (jax.tree.structure(state), tuple(jax.tree.leaves((pspecs, mspecs), is_leaf=sharding.is_spec)))
        if key not in self._steps:
            strategy = parallel.make_strategy(self.strategy, self.mesh, pspecs)
            self._steps[key] = strategy.evaluate(self._sums, mspecs)
        return self._steps[key]

    def __call__(self, state: TrainState, batch: Mapping) -> dict:
        _check_not_donated(state)
        return self._compiled(state)(state, self.shard(batch))

    def step(self, state: TrainState, batch: Mapping) -> dict:
        """The eval step on a batch already on the mesh (no checks, no copies)."""
        return self._compiled(state)(state, batch)


def make_eval_step(eval_fn: EvalFn, *, mesh: Mesh | int | None = None, strategy: str = "jit") -> Evaluator:
    """Build an eval step from ``eval_fn(params, model_state, batch) -> {name: [B] values}``."""
    return Evaluator(eval_fn, make_mesh(mesh), strategy)
