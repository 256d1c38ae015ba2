"""``jt.from_nnx``: a Flax NNX module as the pure functions ``make_train_step`` / ``make_eval_step`` take.

    adapter = jt.from_nnx(model, loss=lambda logits, batch: (loss, {"accuracy": acc}),
                          per_example=lambda logits, batch: {"loss": ..., "accuracy": ...})
    trainer = jt.make_train_step(adapter.loss_fn, tx, mesh=mesh, param_sharding=adapter.rules or "replicated")
    state = trainer.init(adapter.params, adapter.model_state, rng)
    trained = adapter.merge(state)          # an nnx.Module with the trained weights and statistics

``nnx.split`` cuts the module into its graph, its parameters (``nnx.Param``:
``state.params``), its random streams (``nnx.RngState``) and the rest
(``nnx.BatchStat`` ...: ``state.model_state``); both are kept as plain
nested dicts (what the sharding rules, checkpoints and digests see). Inside
the step the module is rebuilt with ``nnx.merge(..., copy=True)`` (without
the copy a BatchNorm forward under ``jax.value_and_grad`` raised
TraceContextError in flax 0.12.8), its random streams reseeded from the
step's key (``nnx.Dropout`` draws from it), and every ``nnx.BatchNorm``
given the axis the step splits the batch over (``jt.step_context()``), so
batch statistics are the GLOBAL batch's under every strategy.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import jax
from flax import nnx

from jaxtrain.core.context import dropout, step_context
from jaxtrain.parallel.rules import logical_spec


def _called_with_train(model) -> bool:
    return "train" in inspect.signature(type(model).__call__).parameters


def default_inputs(model, batch, train: bool):
    """``model(batch["image"], train=train)``, or ``model(batch["image"])`` for a module without ``train``."""
    return model(batch["image"], train=train) if _called_with_train(model) else model(batch["image"])


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _filled(template, pure: dict):
    state = jax.tree.map(lambda x: x, template)  # a fresh State of the same structure
    nnx.replace_by_pure_dict(state, pure)
    return state


class NnxAdapter:
    """``params`` / ``model_state`` (plain dicts), ``loss_fn``, ``eval_fn``, ``rules``, ``merge(state)``."""

    def __init__(self, model: nnx.Module, loss: Callable, per_example: Callable | None = None,
                 inputs: Callable = default_inputs):
        self.graphdef, params, self._rng_state, model_state = nnx.split(model, nnx.Param, nnx.RngState, ...)
        self.params, self.model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
        self._params, self._model_state = _abstract(params), _abstract(model_state)
        self._streams = sorted({s.tag for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)})
        self.loss, self.per_example, self.inputs = loss, per_example, inputs
        self.rules = _rules(params)

    def module(self, params: dict, model_state: dict, rng: jax.Array | None = None) -> nnx.Module:
        """The module holding ``params`` and ``model_state`` (its streams reseeded from ``rng`` if given)."""
        model = nnx.merge(self.graphdef, _filled(self._params, params), self._rng_state,
                          _filled(self._model_state, model_state), copy=True)
        ctx = step_context()  # inside a train step: the axis its batch is split over
        axis = ctx.batch_axis if ctx else None
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.BatchNorm):
                node.axis_name = axis
        if self._streams:  # fresh keys each step (evaluation: fixed ones, for modules that draw in eval mode)
            rng = jax.random.key(0) if rng is None else rng
            nnx.reseed(model, **{tag: jax.random.fold_in(rng, i) for i, tag in enumerate(self._streams)})
        return model

    def loss_fn(self, params, model_state, batch, rng):
        """The train-step contract: ``(loss, (model_state, metrics))``; the module in training mode."""
        model = self.module(params, model_state, rng)
        model.train()
        loss, metrics = self.loss(self.inputs(model, batch, True), batch)
        return loss, (nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3]), metrics)

    def eval_fn(self, params, model_state, batch):
        """The eval-step contract: per-example metrics, the module in evaluation mode (running statistics)."""
        if self.per_example is None:
            raise TypeError("from_nnx(..., per_example=fn) is needed for make_eval_step: fn(outputs, batch) -> "
                            "{name: [B] values}")
        model = self.module(params, model_state)
        model.eval()
        return self.per_example(self.inputs(model, batch, False), batch)

    def merge(self, state) -> nnx.Module:
        """A host-side module holding a TrainState's parameters and model state."""
        host = jax.device_get(state)
        return self.module(host.params, host.model_state)


def _rules(params) -> list:
    """The module's own sharding annotations (``nnx.with_partitioning``: logical names, or mesh axes) as
    ``param_sharding`` rules."""
    rules = []
    for path, var in nnx.to_flat_state(params):
        meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
        names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
        if names:
            rules.append(("^" + re.escape("/".join(map(str, path))) + "$", logical_spec(names)))
    return rules


def from_nnx(model: nnx.Module, *, loss: Callable, per_example: Callable | None = None,
             inputs: Callable = default_inputs) -> NnxAdapter:
    """Adapt ``model`` (a concrete or ``nnx.eval_shape``'d module) for jaxtrain's steps.

    ``loss(outputs, batch) -> (scalar loss, {name: scalar})``;
    ``per_example(outputs, batch) -> {name: [B] values}`` (for
    ``make_eval_step``); ``inputs(model, batch, train) -> outputs`` (default:
    ``model(batch["image"], train=train)``, or without ``train`` if the
    module's ``__call__`` takes none). Random draws: the module's streams are
    reseeded from the step's key each step (same seed and strategy, same
    draws); ``jaxtrain.nn.flax_nnx.Dropout`` draws per example instead, the
    same under every strategy and device count (``jt.dropout``).
    """
    return NnxAdapter(model, loss, per_example, inputs)


class Dropout(nnx.Module):
    """Dropout whose mask is the same for an example under every strategy and device count (``jt.dropout``)."""

    def __init__(self, rate: float, *, deterministic: bool = False):
        self.rate, self.deterministic = rate, deterministic

    def __call__(self, x, *, deterministic: bool | None = None):
        off = self.deterministic if deterministic is None else deterministic
        return dropout(x, self.rate, deterministic=off)
