"""Knowledge distillation: a student learns from a finished run's softened outputs, inside the same train step.

The loss (Hinton et al.) mixes the hard-label cross-entropy with the
teacher's soft targets at temperature T:

    (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))

T^2 keeps the soft term's gradient on the scale of the hard one's as T
grows. The teacher's forward pass runs in the student's compiled step, on
each device's share of the batch, in evaluation mode: its params and model
state are step inputs held in ``model_state["teacher"]`` as a ``Frozen``
part (never updated, never averaged over devices, bit-identical after
training). The student's own model state is ``model_state["student"]``.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import optax

from jaxtrain import models
from jaxtrain.core.state import Frozen, is_frozen
from jaxtrain.errors import ConfigError
from jaxtrain.models import classify
from jaxtrain.driver import export


def soft_loss(student_logits: jax.Array, teacher_logits: jax.Array, temperature: float) -> jax.Array:
    """Mean over the batch of ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` (no gradient to the
    teacher)."""
    t = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / temperature
    s = student_logits.astype(jnp.float32) / temperature
    return temperature**2 * optax.kl_divergence(jax.nn.log_softmax(s), jax.nn.softmax(t)).mean()


def make_head(temperature: float, alpha: float, kernels: str = "jnp"):
    """head(logits, batch) -> (loss, metrics) for ``batch["teacher_logits"]`` beside the labels (their
    cross-entropy with ``kernels``)."""

    def head(logits, batch):
        hard, metrics = classify.mean_loss(logits, batch["label"], kernels)
        soft = soft_loss(logits, batch["teacher_logits"], temperature)
        return (1 - alpha) * hard + alpha * soft, {**metrics, "hard_loss": hard, "soft_loss": soft}

    return head


def distilled(student: models.Model, teacher: models.Model, teacher_params, teacher_state, temperature: float,
              alpha: float, kernels: str = "jnp") -> models.Model:
    """``student`` trained against ``teacher`` (whose params and state are given): a registry Model to train."""
    if not isinstance(student, models.Distillable):
        raise ConfigError(f"model {student.name} cannot be a distillation student (its loss takes no head)")
    if differs := _differs(teacher, student):
        raise ConfigError(f"the teacher ({teacher.name}) was trained on {differs}: use the teacher's dataset")
    loss_fn = student.with_head(make_head(temperature, alpha, kernels))
    frozen = Frozen({"params": teacher_params, "model_state": teacher_state})

    def loss(params, model_state, batch, rng):
        t = model_state["teacher"].tree
        logits = teacher.logits(t["params"], t["model_state"], batch["image"])
        value, (own, metrics) = loss_fn(params, model_state["student"], {**batch, "teacher_logits": logits}, rng)
        return value, ({"student": own, "teacher": model_state["teacher"]}, metrics)

    def init(rng):
        params, own = student.init(rng)
        return params, {"student": own, "teacher": frozen}

    return models.Model(name=student.name, init=init, loss_fn=loss,
                        eval_fn=lambda params, state, batch: student.eval_fn(params, state["student"], batch),
                        logits=lambda params, state, images: student.logits(params, state["student"], images),
                        logical_axes=student.logical_axes, input_shape=student.input_shape,
                        num_classes=student.num_classes, classifier=student.classifier, init_name=student.init_name,
                        conv=student.conv)


def own_state(model_state):
    """The model's own state (what its saved model keeps): a distilled student's, a linear probe's (``Frozen``)
    or the plain one."""
    if is_frozen(model_state):
        return model_state.tree
    return model_state["student"] if isinstance(model_state, dict) and "teacher" in model_state else model_state


def teacher_from_run(run_dir: str) -> tuple[models.Model, dict, dict]:
    """(model, params, model_state) of a finished run (``--teacher RUN_DIR``): one-line errors for a directory that
    is missing, holds no saved model, or holds a model that cannot be a teacher."""
    meta, params, state = export.load(run_dir, param="teacher")
    teacher = export.model_of(meta)
    return teacher, params, state


def _differs(teacher: models.Model, student: models.Model) -> str:
    """What of the student's data differs from the teacher's, and only that: a folder's classes are not known
    before its index is read (the teacher's are assumed until then), so a message on its images names none."""
    t, s = ("x".join(map(str, m.input_shape)) for m in (teacher, student))
    parts = [f"{t} images and the student's data has {s}"] if t != s else []
    if teacher.num_classes != student.num_classes:
        parts.append(f"{teacher.num_classes} classes and the student's data has {student.num_classes}")
    return "; ".join(parts)
