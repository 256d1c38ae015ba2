"""Softmax classification metrics shared by the models (logits taken in fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def per_example(logits: jax.Array, labels: jax.Array) -> dict:
    """Cross-entropy and correctness of each example: the eval-step contract."""
    logits = logits.astype(jnp.float32)
    return {
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
        "accuracy": (logits.argmax(-1) == labels).astype(jnp.float32),
    }


def mean_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict]:
    """(mean cross-entropy, {"accuracy": mean}): what a train-step loss_fn returns."""
    metrics = per_example(logits, labels)
    return metrics["loss"].mean(), {"accuracy": metrics["accuracy"].mean()}


def label_loss(logits: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
    """``mean_loss`` against ``batch["label"]``: a model's default loss head."""
    return mean_loss(logits, batch["label"])
