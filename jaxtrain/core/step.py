"""The train step, top to bottom, as one would write it by hand.

    step_key = fold_in(state.rng, state.step)
    on each shard of the batch (``local``):
        cast params and batch to the compute dtype
        loss, grads = value_and_grad(loss_fn)       per micro-batch, summed (``accumulate.microbatched``)
    reduce grads, loss and metrics over the shards  (``reduced``: below, for every strategy)
    grads /= loss scale; skip the update if any is not finite (fp16)
    params, opt_state = tx.update(...)
    metrics: loss, the loss_fn's own, lr, loss scale

``make_step`` is that story as code, the reduction included. The strategies differ in one place only: where
the gradients are reduced, and how (``reduced`` in ``make_step``)::

    jit        one program on global arrays: XLA (GSPMD) inserts the all-reduce (FSDP: a reduce-scatter)
    explicit   the same, the shardings in the arrays' types (``jax.sharding.reshard`` where they are pinned)
    shard_map  per device (``jax.shard_map`` over "data"): psum / n; FSDP: params all_gather'ed, grads psum_scatter'ed
    ring       per device, as shard_map, with our ring's all-reduce (``lax.ppermute``: ``parallel/collectives.py``)
    pmap       per device, the whole step inside ``jax.pmap`` (replicated state only)
    jit and explicit accumulating micro-batches: per device (a shard_map), one reduction per update, not k

A strategy hands the step a ``Reduction``, a value saying which (its collectives, its wrapping);
``jaxtrain.parallel.strategies`` makes it, and compiles the step with the state's shardings. The update runs
on global arrays after the reduction: an optimizer that looks across parameters (a global-norm clip) sees
the whole gradient under every sharding.

What a loss_fn may ask of the step while it is traced (its key, the mesh, the axis its batch is split
over, ``dropout``), and the keys' rule: ``jaxtrain.core.context``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxtrain.core import accumulate, optim, precision as prec
from jaxtrain.core.context import StepContext, shard_context, traced_under
from jaxtrain.core.state import TrainState, keep_frozen, map_unfrozen
from jaxtrain.errors import ConfigError

LossFn = Callable  # (params, model_state, batch, key) -> (loss, (model_state, metrics))
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


def cast_loss(loss_fn: LossFn, policy: prec.Precision) -> LossFn:
    """``loss_fn`` on params and batch cast to the policy's compute dtype, its loss in the output dtype."""

    def loss(params, model_state, batch, key):
        value, aux = _checked_loss_output(loss_fn(prec.cast_floats(params, policy.compute_dtype), model_state,
                                                  prec.cast_floats(batch, policy.compute_dtype), key))
        return value.astype(policy.output_dtype), aux

    return loss


def gradients(loss_fn: LossFn, policy: prec.Precision):
    """``grads(params, model_state, batch, ctx, scale) -> (grads, loss, model_state, metrics)``: fp32 gradients of
    the (loss-scaled) loss over the examples given, computed in the policy's compute dtype."""
    cast = cast_loss(loss_fn, policy)

    def grads(params, model_state, batch, ctx: StepContext, scale):
        def scaled_loss(p):
            loss, (new_model_state, metrics) = cast(p, model_state, batch, ctx.key)
            return loss * scale, (loss, new_model_state, metrics)

        with traced_under(ctx):  # the forward and the backward pass (a kernel's custom VJP) are traced under it
            (_, (loss, new_model_state, metrics)), g = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        return g, loss, new_model_state, metrics

    return grads


@dataclasses.dataclass(frozen=True)
class Reduction:
    """Where and how a strategy reduces the shards' gradients (``jaxtrain.parallel.strategies`` makes it).

    ``comm`` None: one program on global arrays (``jit``, ``explicit``), XLA inserting the collectives;
    ``place(tree, what)`` pins ``what`` ("params", "model_state": gathered where the loss reads them; "grads":
    placed as the update takes them). Else per device: ``wrap(fn)`` runs ``fn`` on every device's shard
    (``shard_map`` over the batch axes ``axes``, or ``pmap``), ``comm`` its collectives (``lax``'s or our ring's:
    ``jaxtrain.parallel.collectives.Comm``), ``state_dims`` the FSDP dimension of each model-state leaf (None:
    none sharded). ``model(fn)``: the loss_fn as the strategy traces it (``explicit``: under ``auto_axes``)."""

    mesh: jax.sharding.Mesh
    model: Callable = lambda fn: fn
    place: Callable | None = None
    wrap: Callable | None = None
    comm: object = None
    axes: object = None
    state_dims: object = None


def make_step(loss_fn: LossFn, tx: optax.GradientTransformation, policy: prec.Precision, micro_batches: int,
              reduction: Reduction) -> Callable:
    """The train step ``(state, batch) -> (state, metrics)`` on global arrays, every stage in order; the
    gradients reduced over the shards as ``reduction`` says."""
    r = reduction
    grads_of = gradients(r.model(loss_fn), policy)  # cast, loss, value_and_grad (under the shard's context)
    if micro_batches > 1:
        grads_of = accumulate.microbatched(grads_of, micro_batches)  # ... the means over k micro-batches (scan)

    def local(params, model_state, loss_scale, batch, ctx: StepContext):
        """On one shard (a shard's examples, or all under "jit"): gradients and means, NOT reduced over shards."""
        g, loss, model_state, metrics = grads_of(params, model_state, batch, ctx, prec.current_scale(loss_scale))
        return prec.cast_floats(g, policy.reduce_dtype), loss, model_state, metrics

    if r.comm is None:  # jit, explicit: one program sees the global batch; XLA reduces where the shards' grads meet
        def reduced(params, model_state, loss_scale, batch, step_key):
            # Gathered params at the loss, grads sharded like their params: without the first pin GSPMD gathered
            # activations instead. (XLA:CPU still reduces FSDP grads as all-reduce + slice: docs/sharding.md.)
            params = r.place(params, "params")
            model_state = r.place(model_state, "model_state")  # an FSDP teacher: gathered
            grads, *rest = local(params, model_state, loss_scale, batch, shard_context(step_key, batch, r.mesh))
            return r.place(grads, "grads"), *rest
    else:  # per device (shard_map, ring, pmap; jit and explicit accumulating): the step calls the collectives
        comm = r.comm

        def per_device(params, model_state, loss_scale, batch, step_key):
            d = lax.axis_index(r.axes)  # on a hybrid mesh: replica-major, as the batch is split
            ctx = shard_context(step_key, batch, r.mesh, d, r.axes, comm.vary)
            whole_state = model_state if r.state_dims is None else comm.gather_like(model_state, r.state_dims)
            # FSDP: the parameters all-gathered before the loss
            grads, loss, new_state, metrics = local(comm.gather(params), whole_state, loss_scale, batch, ctx)
            loss, metrics = comm.mean((loss, metrics))  # psum / n (the ring: ours)
            grads = comm.scatter_mean(grads)  # the same; FSDP: reduce-scattered to this device's shard
            return grads, loss, map_unfrozen(comm.mean, keep_frozen(new_state, model_state)), metrics  # BatchNorm

        reduced = r.wrap(per_device)

    def step(state: TrainState, batch):
        step_key = jax.random.fold_in(state.rng, state.step)
        # local on every shard, reduced over the shards (each shard's StepContext: shard_context)
        grads, loss, model_state, metrics = reduced(state.params, state.model_state, state.loss_scale, batch,
                                                    step_key)
        # unscale; the update (skipped, fp16, where any gradient is not finite); the metrics
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

    return step


def scanned(step: Callable, unroll: bool | None = False) -> Callable:
    """``(state, batches) -> (state, metrics)``: ``step`` once per batch of ``batches`` (every array stacked on a
    leading axis of K, one batch per step), in one program (``lax.scan``); each metric comes back stacked [K].

    The same K steps as K calls of ``step``; bit for bit where XLA compiles the loop's body as it compiles a
    single step. XLA:CPU canonicalizes convolutions in the entry computation only, so in a loop's body XLA's
    convolutions (not oneDNN's) sum in another order, and run ~11x slower: ``unroll=True`` lays the K steps out
    straight (no loop), bit for bit again, its compile time growing with K; ``None`` does so where the program is
    compiled for a CPU and keeps the loop elsewhere (``accumulate.platform_scan``, as the micro-batches);
    ``False`` keeps the loop everywhere: the runs' choice, since unrolled the ring strategy's sums round another
    way than one step's (docs/train-step.md, "Many steps per call")."""

    def steps(state, batches):
        if unroll is None:
            return accumulate.platform_scan(step, state, batches, jax.tree.leaves(batches)[0].shape[0])
        return lax.scan(step, state, batches, unroll=unroll)

    return steps


def eval_sums(eval_fn: EvalFn):
    """``sums(params, model_state, batch)``: each per-example metric summed over the unmasked examples, and
    ``count`` (a batch's ``"mask"``: 1 = real example, 0 = padding)."""

    def sums(params, model_state, batch):
        batch = dict(batch)
        mask = batch.pop("mask", None)
        per_example = eval_fn(params, model_state, batch)
        size = jax.tree.leaves(batch)[0].shape[0]
        mask = jnp.ones((size,), jnp.float32) if mask is None else mask.astype(jnp.float32)
        # where, not a product: a padding row's value never counts, even a NaN (e.g. its label -1)
        out = {k: jnp.sum(jnp.where(mask > 0, v.astype(jnp.float32) * mask, 0.0)) for k, v in per_example.items()}
        out["count"] = jnp.sum(mask)
        return out

    return sums
