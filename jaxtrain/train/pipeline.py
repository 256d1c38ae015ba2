"""Pipeline parallelism over the mesh axis ``"stage"``: GPipe and a circular (interleaved) schedule.

A pipelined model is three functions and ``params = {"embed": E, "stages": S, "head": H}``:

- ``embed_fn(E, batch) -> x`` (an array ``[B, ...]``),
- ``stage_fn(layer_params, x) -> x``: ONE layer (every layer the same shapes, as transformer blocks are),
- ``head_loss_fn(H, x, batch) -> (loss, metrics)``: means over the examples given.

A head tied to the embedding (a language model's logits ``x @ E["wte"].T``): with ``head_reads_embed=True`` the
head fns take ``(H, E)`` where they took ``H``: ``head_loss_fn((H, E), x, batch)``, and ``eval_fn``'s
``head_eval_fn((H, E), x, batch)``. E is then used twice, by the first stage's embedding and the last stage's
head; its gradient is the sum of the two uses, as the unpipelined model's autodiff gives (both are replicated
inputs of the ``shard_map``, whose transpose sums their gradients over the stages). There is one E, stored once.

The reference is the sequential loop ``x = embed_fn(E, b); for i in range(L): x = stage_fn(S[i], x)``, then the
head (``jaxtrain.models.sequential.sequential_loss``, which takes ``head_reads_embed`` too). Placement: the L
layers form ``stages x repeats`` chunks of K consecutive layers; chunk c runs on stage ``c % stages`` (its repeat
is ``c // stages``). The stored ``"stages"`` leaves are ``[repeats, stages, K, ...]``, sharded over ``"stage"`` on
their second axis, so each stage's layers live on its devices only, and a row-major reshape gives ``[L, ...]`` in
layer order (``layers``).

The embedding and the head are replicated: every stage device computes them, the first stage uses the
embedding and the last the head (their gradients are summed over the stages by the transpose of
``shard_map``'s replicated inputs). They are small next to the blocks, and a uniform SPMD program needs
no extra transfers for them.

Schedule (both): at tick t stage s works on item ``i = t - s`` (micro-batch ``i % M`` of repeat
``i // M``) when ``0 <= i < R*M``, then sends its output to stage ``s + 1`` with ``lax.ppermute`` (the last
stage back to the first, for the next repeat): ``R*M + S - 1`` ticks, bubble ``(S-1) / (R*M + S-1)``.
``repeats=1`` is GPipe, ``microbatches=1`` the naive model parallelism (one stage busy at a time). The
backward pass is autodiff of the scan over ticks: the transposed scan runs the ticks in reverse with the
ppermutes reversed, i.e. all forward ticks, then all backward ticks (GPipe). Each tick's activations are
kept for it, or with ``remat`` (a ``jaxtrain.core.remat`` policy: "full" keeps only the tick's input) less of
them (``jax.checkpoint`` around each tick's chunk of layers).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.choices import PIPELINE_SCHEDULES
from jaxtrain.core import precision as prec
from jaxtrain.core.remat import policy, remat as remat_policy
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel.devices import DATA_AXIS, make_mesh
from jaxtrain.train.trainer import Trainer

STAGE_AXIS = "stage"


def layers(stored):
    """Stored ``"stages"`` leaves ``[repeats, stages, K, ...]`` -> ``[L, ...]`` in layer order."""
    return jax.tree.map(lambda w: w.reshape(-1, *w.shape[3:]), stored)


def _stored(stages, num_stages: int, repeats: int):
    """``[L, ...]`` leaves -> ``[repeats, num_stages, L / (num_stages * repeats), ...]``."""
    counts = {w.shape[0] if w.ndim else None for w in jax.tree.leaves(stages)}
    if len(counts) != 1 or None in counts:
        raise ConfigError(f"every leaf of params['stages'] needs the same leading axis of L layers, got {counts}")
    n = counts.pop()
    if n % (num_stages * repeats):
        raise ConfigError(f"{n} layers do not split into {num_stages} stages x {repeats} repeats: "
                          f"{_splits(n, num_stages, repeats)}")
    return jax.tree.map(lambda w: w.reshape(repeats, num_stages, n // (num_stages * repeats), *w.shape[1:]), stages)


def _splits(layers: int, stages: int, repeats: int) -> str:
    """What splits ``layers`` instead: other stage counts, other repeats, or another layer count."""

    def either(xs):  # "2, 4 or 8"
        return ", ".join(map(str, xs[:-1])) + (" or " if len(xs) > 1 else "") + str(xs[-1])

    ways = []
    stage_counts = [s for s in range(2, layers + 1) if layers % (s * repeats) == 0]
    if stage_counts:
        ways.append(f"a 'stage' axis of {either(stage_counts)} ({named('mesh')}) with {named('repeats', repeats)}")
    repeat_counts = [r for r in range(1, layers + 1) if layers % (stages * r) == 0]
    if repeat_counts:
        ways.append(f"{named('repeats', either(repeat_counts))} with {stages} stages")
    ways.append(f"a model whose layer count is a multiple of {stages * repeats}")
    return "stages x repeats must divide the layer count: use " + "; or ".join(ways)


def _schedule(embed_fn, stage_fn, num_stages: int, repeats: int, microbatches: int, remat: str, dtype):
    """Per device: ``(E, stored stages, batch) -> (x, idle)``: x after the last layer (valid on the last stage
    only), idle the fraction of stage-ticks that had no micro-batch (the bubble, counted as the schedule ran)."""
    S, R, M = num_stages, repeats, microbatches
    ring = [(j, (j + 1) % S) for j in range(S)]

    def chunk(params, x):  # this device's K layers of one repeat
        return lax.scan(lambda x, p: (stage_fn(p, x), None), x, params)[0]

    chunk = remat_policy(chunk, remat)

    def run(embed, stored, batch):
        s = lax.axis_index(STAGE_AXIS)
        mine = jax.tree.map(lambda w: w[:, 0], stored)  # [R, K, ...], fp32: cast per tick (see PipelineTrainer)
        x0 = embed_fn(prec.cast_floats(embed, dtype), prec.cast_floats(batch, dtype))
        micro = x0.reshape(M, x0.shape[0] // M, *x0.shape[1:])

        def vary(x):
            return lax.pcast(x, (DATA_AXIS, STAGE_AXIS), to="varying")

        zeros = vary(jnp.zeros(micro.shape, micro.dtype))

        def tick(carry, t):
            x, loop, outs, busy = carry
            i = t - s
            item = jnp.clip(i, 0, R * M - 1)
            m, r = item % M, item // M
            first = micro[m] if R == 1 else jnp.where(r == 0, micro[m], loop[m])
            y = chunk(prec.cast_floats(jax.tree.map(lambda w: w[r], mine), dtype), jnp.where(s == 0, first, x))
            done = (i >= 0) & (i < R * M) & (s == S - 1) & (r == R - 1)
            outs = outs.at[m].set(jnp.where(done, y, outs[m]))
            received = lax.ppermute(y, STAGE_AXIS, ring)
            if R > 1:  # the first stage keeps what the last one finished, for its next repeat
                back = t - (S - 1)
                slot = jnp.clip(back, 0, R * M - 1) % M
                keep = (s == 0) & (back >= 0) & (back < (R - 1) * M)
                loop = loop.at[slot].set(jnp.where(keep, received, loop[slot]))
            busy = busy + ((i >= 0) & (i < R * M)).astype(jnp.float32)
            return (received, loop, outs, busy), None

        ticks = R * M + S - 1
        start = (zeros[0], zeros, zeros, vary(jnp.zeros((), jnp.float32)))
        (_, _, outs, busy), _ = lax.scan(tick, start, jnp.arange(ticks))
        idle = 1 - lax.psum(busy, STAGE_AXIS) / (S * ticks)  # this step's idle stage-ticks, counted as run
        return outs.reshape(x0.shape), idle

    return run


def _on_last_stage(tree, num_stages: int):
    """The last stage's values, everywhere (the others computed on placeholders)."""
    last = lax.axis_index(STAGE_AXIS) == num_stages - 1
    return jax.tree.map(lambda v: lax.psum(jnp.where(last, v, jnp.zeros_like(v)), STAGE_AXIS), tree)


class PipelineTrainer(Trainer):
    """A ``Trainer`` whose loss runs the pipeline schedule: same TrainState, loop, checkpoints and evaluator."""

    def __init__(self, embed_fn, stage_fn, head_loss_fn, tx, mesh, microbatches: int, schedule: str, repeats: int,
                 precision, remat: str, head_reads_embed: bool = False):
        if STAGE_AXIS not in mesh.axis_names:
            raise ConfigError(f"pipelining needs a mesh axis {STAGE_AXIS!r}, e.g. jt.make_mesh(devices, "
                              f"axes={{'data': 1, 'stage': 4}}); this mesh has {', '.join(mesh.axis_names)}")
        if set(mesh.axis_names) - {DATA_AXIS, STAGE_AXIS}:
            raise ConfigError(f"a pipeline's mesh has the axes {DATA_AXIS!r} and {STAGE_AXIS!r} only; this one has "
                              f"{', '.join(mesh.axis_names)} (a hybrid mesh's 'replica' axis: use data=N instead)")
        if schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"unknown schedule {schedule!r}: use one of {', '.join(PIPELINE_SCHEDULES)}")
        policy(remat)  # an unknown name: a ConfigError now
        if schedule == "gpipe" and repeats != 1:
            raise ConfigError(f"{named('repeats', repeats)} needs "
                              f"{named('schedule', repr('circular'), setting='pipeline_schedule')} (gpipe has one "
                              "chunk per stage)")
        if microbatches < 1 or repeats < 1:
            raise ConfigError(f"microbatches and repeats must be >= 1, got {microbatches} and {repeats}")
        self.num_stages = mesh.shape[STAGE_AXIS]
        if schedule == "circular" and microbatches < self.num_stages:
            raise ConfigError(f"the circular schedule needs microbatches >= stages ({microbatches} < "
                              f"{self.num_stages}): a micro-batch must leave the last stage before it re-enters")
        self.microbatches, self.schedule, self.repeats, self.remat = microbatches, schedule, repeats, remat
        self.head_reads_embed = head_reads_embed
        # The params reach the loss in fp32 and are cast where used: the gradients of the stage params then
        # add up over the ticks in fp32 (cast before the loss, they would add up in bf16 / fp16).
        mixed = prec.get_policy(precision)
        self.compute_dtype = mixed.compute_dtype
        forward = functools.partial(_schedule, embed_fn, stage_fn, self.num_stages, repeats, microbatches, remat)
        self._forward, self._forward32 = forward(mixed.compute_dtype), forward(jnp.float32)  # train, eval
        super().__init__(self._loss(head_loss_fn), tx, mesh, "jit", dataclasses.replace(
            mixed, compute_dtype=jnp.float32), param_sharding=[(r"^stages/|^stages$", P(None, STAGE_AXIS))],
            min_size=1, micro_batches=microbatches)  # each data shard's examples split into the micro-batches

    @property
    def bubble(self) -> float:
        """The schedule's idle fraction: (S-1) / (R*M + S-1)."""
        s, busy = self.num_stages, self.repeats * self.microbatches
        return (s - 1) / (busy + s - 1)

    def _mapped(self, fn, out_specs):
        specs = (P(), P(None, STAGE_AXIS), P(), self.batch_plan.batch.spec)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=out_specs)

    def _head(self, head, embed):
        """What the head fns take: H, or ``(H, E)`` for a head that reads the embedding (``head_reads_embed``)."""
        return (head, embed) if self.head_reads_embed else head

    def _loss(self, head_loss_fn):
        def per_device(embed, stored, head, batch):
            x, idle = self._forward(embed, stored, batch)
            low = prec.cast_floats((self._head(head, embed), batch), self.compute_dtype)
            loss, metrics = _on_last_stage(head_loss_fn(*low[:1], x, *low[1:]), self.num_stages)
            return lax.pmean((loss, {**metrics, "pipeline_bubble": idle}), DATA_AXIS)

        def loss_fn(params, model_state, batch, rng):
            loss, metrics = self._mapped(per_device, P())(params["embed"], params["stages"], params["head"], batch)
            return loss, (model_state, metrics)

        return loss_fn

    def eval_fn(self, head_eval_fn: Callable):
        """An ``eval_fn`` for ``make_eval_step`` from ``head_eval_fn(H, x, batch) -> {name: [B] values}``
        (``(H, E)`` for H with ``head_reads_embed``)."""
        def per_device(embed, stored, head, batch):
            x = self._forward32(embed, stored, batch)[0]  # fp32, as make_eval_step evaluates any model
            return _on_last_stage(head_eval_fn(self._head(head, embed), x, batch), self.num_stages)

        def eval_fn(params, model_state, batch):
            return self._mapped(per_device, P(DATA_AXIS))(params["embed"], params["stages"], params["head"], batch)

        return eval_fn

    def _pipelined(self, params):
        if not isinstance(params, dict) or set(params) != {"embed", "stages", "head"}:
            raise ConfigError("a pipelined model's params are {'embed': E, 'stages': S, 'head': H}; got "
                              f"{sorted(params) if isinstance(params, dict) else type(params).__name__}")
        return {**params, "stages": _stored(params["stages"], self.num_stages, self.repeats)}

    def _maker(self, params, model_state, init_fn):
        """``init(params)`` or ``init(init_fn=f, rng=key)`` with ``f(rng) -> {"embed", "stages", "head"}``
        (or ``(that, {})``; stages leaves ``[L, ...]``); stored as the schedule places them."""
        if init_fn is not None:

            def first(out):  # the params of (params, model_state)
                return out[0] if isinstance(out, tuple) else out

            return super()._maker(None, None, lambda r: (self._pipelined(first(init_fn(r))), {}))
        return super()._maker(None if params is None else self._pipelined(params), model_state, None)

    def layout(self, params, say: bool = True) -> dict:
        """As ``Trainer.layout``, for params with ``[L, ...]`` stages leaves (arrays or shapes)."""
        return super().layout(jax.eval_shape(self._pipelined, params), say)

    @property
    def pipeline_layout(self) -> dict:
        """How the layers are stored (``[repeats, stages, K, ...]``): a checkpoint must match it."""
        return {"stages": self.num_stages, "repeats": self.repeats}

    def describe(self) -> dict:
        return {"stages": self.num_stages, "microbatches": self.microbatches, "schedule": self.schedule,
                "repeats": self.repeats, "bubble": self.bubble}


def make_pipeline_step(embed_fn, stage_fn, head_loss_fn, tx: optax.GradientTransformation, *, mesh,
                       microbatches: int = 1, schedule: str = "gpipe", repeats: int = 1, precision="fp32",
                       remat: str = "none", head_reads_embed: bool = False) -> PipelineTrainer:
    """A pipelined train step on ``mesh``'s ``"stage"`` axis (and data parallel over ``"data"``); see the module
    (``head_reads_embed``: the head fns take ``(H, E)``, a head tied to the embedding)."""
    return PipelineTrainer(embed_fn, stage_fn, head_loss_fn, tx, make_mesh(mesh), microbatches, schedule, repeats,
                           precision, remat, head_reads_embed)
