"""Softmax classification metrics shared by the models (logits taken in fp32); ``kernels="pallas"``: the
cross-entropy of the train loss is the fused Pallas kernel (jaxtrain.kernels.softmax_ce)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxtrain.choices import KERNELS


def cross_entropy(logits: jax.Array, labels: jax.Array, kernels: str = "jnp") -> jax.Array:
    """Per-example softmax cross-entropy (at least fp32: float64 stays float64) with integer labels: optax's
    (``"jnp"``) or the Pallas kernel."""
    if kernels == "pallas":
        from jaxtrain.kernels import softmax_ce

        return softmax_ce.cross_entropy(logits, labels)
    if kernels != "jnp":
        raise ValueError(f"unknown kernels {kernels!r}: choose one of {', '.join(KERNELS)}")
    wide = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(wide, labels)


def per_example(logits: jax.Array, labels: jax.Array, kernels: str = "jnp") -> dict:
    """Cross-entropy and correctness of each example: the eval-step contract."""
    return {
        "loss": cross_entropy(logits, labels, kernels),
        "accuracy": (logits.argmax(-1) == labels).astype(jnp.float32),
    }


def mean_loss(logits: jax.Array, labels: jax.Array, kernels: str = "jnp") -> tuple[jax.Array, dict]:
    """(mean cross-entropy, {"accuracy": mean}): what a train-step loss_fn returns."""
    metrics = per_example(logits, labels, kernels)
    return metrics["loss"].mean(), {"accuracy": metrics["accuracy"].mean()}


def label_loss(logits: jax.Array, batch: dict, kernels: str = "jnp") -> tuple[jax.Array, dict]:
    """``mean_loss`` against ``batch["label"]``: a model's default loss head."""
    return mean_loss(logits, batch["label"], kernels)


def loss_head(kernels: str = "jnp"):
    """``label_loss`` with these kernels: ``head(logits, batch) -> (loss, metrics)``."""
    return label_loss if kernels == "jnp" else functools.partial(label_loss, kernels=kernels)
