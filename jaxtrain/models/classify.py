"""Softmax classification metrics shared by the models (logits taken in fp32); ``kernels="pallas"``: the
cross-entropy of the train loss is the fused Pallas kernel (jaxtrain.kernels.softmax_ce).

Labels are checked twice, both for free: their dtype and shape while the step is traced (static), and
their values inside the step: a label outside ``0 .. classes - 1`` gets a NaN loss (never another class's
loss: a ``-1`` would otherwise wrap to the last class and look plausible), and ``mean_loss`` reports the
fraction of such labels as the metric ``LABELS_OUT_OF_RANGE``, which the trainer and the loop read for every
step once it is done (``jaxtrain.parallel.call_checks``); ``per_example`` flags each, and ``loop.evaluate`` reads
their sum over the evaluation set.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxtrain.choices import KERNELS, LABELS_OUT_OF_RANGE
from jaxtrain.errors import ConfigError


def checked_labels(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``labels`` if they are integer class indices, one per row of ``logits``; else a ConfigError (at trace
    time: shapes and dtypes are static)."""
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ConfigError(f"batch['label'] is {labels.dtype}: labels are integer class indices "
                          f"0..{logits.shape[-1] - 1} (convert them, e.g. labels.astype(np.int32))")
    if labels.shape != logits.shape[:1]:
        raise ConfigError(f"batch['label'] has examples of shape {labels.shape[1:]}: give one integer class index "
                          "per example, a [batch] array (not one-hot, not [batch, 1])")
    return labels


def wide_labels(labels: jax.Array) -> jax.Array:
    """Integer labels in 32 bits at least (64 stay 64): uint8 labels compared with 300 classes would wrap."""
    return labels if labels.dtype.itemsize >= 4 else labels.astype(jnp.int32)


def outside(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per example: whether its label is not one of the ``logits``' classes (``0 .. C - 1``)."""
    labels = wide_labels(labels)
    return (labels < 0) | (labels >= logits.shape[-1])


def cross_entropy(logits: jax.Array, labels: jax.Array, kernels: str = "jnp") -> jax.Array:
    """Per-example softmax cross-entropy (at least fp32: float64 stays float64) with integer labels: optax's
    (``"jnp"``) or the Pallas kernel; NaN for a label outside the classes."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}: choose one of {', '.join(KERNELS)}")
    bad = outside(logits, checked_labels(logits, labels))
    safe = jnp.where(bad, 0, labels)  # a real class for the gather: its gradient is masked out below
    if kernels == "pallas":
        from jaxtrain.kernels import softmax_ce

        loss = softmax_ce.cross_entropy(logits, safe)
    else:
        wide = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        loss = optax.softmax_cross_entropy_with_integer_labels(wide, safe)
    return jnp.where(bad, jnp.nan, loss)


def ranked_first(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per example: whether its label is ``logits.argmax(-1)`` (of equal largest logits, the first), computed as
    "the label's logit is the largest, and no logit before it equals it": argmax's answer for logits without a
    NaN, from the largest logit the cross-entropy takes too, a gather and a pass for the ties (argmax's (value,
    index) reduction cost ~5% of the GPT's step on XLA:CPU: docs/language-models.md, "Where the gap is"). A row
    holding a NaN ranks no label first; a label outside the classes is never first."""
    top = logits.max(-1)
    classes = logits.shape[-1]
    labels = wide_labels(labels)  # uint8 labels: the columns past 255 counted as themselves
    at_label = jnp.take_along_axis(logits, jnp.clip(labels, 0, classes - 1)[:, None], -1)[:, 0]
    column = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)
    tie_before = jnp.any((column < labels[:, None]) & (logits == top[:, None]), -1)
    return (at_label == top) & ~tie_before & ~outside(logits, labels)


def per_example(logits: jax.Array, labels: jax.Array, kernels: str = "jnp") -> dict:
    """Cross-entropy and correctness of each example (``ranked_first``), and whether its label is outside the
    classes (1.0: summed by the eval step, read by ``loop.evaluate``): the eval-step contract."""
    return {
        "loss": cross_entropy(logits, labels, kernels),
        "accuracy": ranked_first(logits, labels).astype(jnp.float32),
        LABELS_OUT_OF_RANGE: outside(logits, labels).astype(jnp.float32),
    }


def mean_loss(logits: jax.Array, labels: jax.Array, kernels: str = "jnp") -> tuple[jax.Array, dict]:
    """(mean cross-entropy, {"accuracy": mean, LABELS_OUT_OF_RANGE: fraction}): what a train-step loss_fn
    returns."""
    metrics = per_example(logits, labels, kernels)
    return metrics.pop("loss").mean(), {k: v.mean() for k, v in metrics.items()}


def label_loss(logits: jax.Array, batch: dict, kernels: str = "jnp") -> tuple[jax.Array, dict]:
    """``mean_loss`` against ``batch["label"]``: a model's default loss head."""
    return mean_loss(logits, batch["label"], kernels)


def loss_head(kernels: str = "jnp"):
    """``label_loss`` with these kernels: ``head(logits, batch) -> (loss, metrics)``."""
    return label_loss if kernels == "jnp" else functools.partial(label_loss, kernels=kernels)


def linear_probe(model, head=label_loss):
    """``model`` (a registry ``Model``) as a linear probe: its loss is ``head`` over the evaluation-mode
    ``logits`` (BatchNorm on its running statistics, no dropout), and its model state is carried ``Frozen``, so
    the step returns it bit-identical on any number of devices (strategies leave Frozen state out of their
    averages). Which parameters train is the optimizer's: ``freeze`` all but ``model.classifier``."""
    import dataclasses

    from jaxtrain.core.state import Frozen

    def init(rng):
        params, state = model.init(rng)
        return params, Frozen(state)

    def logits(params, model_state, images):
        return model.logits(params, model_state.tree, images)

    def loss_fn(params, model_state, batch, rng):
        del rng
        loss, metrics = head(logits(params, model_state, batch["image"]), batch)
        return loss, (model_state, metrics)

    def eval_fn(params, model_state, batch):
        return model.eval_fn(params, model_state.tree, batch)

    return dataclasses.replace(model, init=init, loss_fn=loss_fn, eval_fn=eval_fn, logits=logits)
