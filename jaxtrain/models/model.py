"""What a model is to the library: ``Model`` (init, loss, eval, logits, how its parameters split) and what only
some models can do (``Distillable``, ``Pipelinable``: a ``Stack`` of identical layers).

No JAX at import time: the command line parses flags first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable

IMAGE_SHAPE = (28, 28, 1)


@dataclasses.dataclass(frozen=True)
class Model:
    """What is trained: ``init(rng) -> (params, model_state)``, its loss and eval fns, its evaluation-mode
    ``logits(params, model_state, images)`` (a teacher's forward, the model summary's FLOPs), and how its
    parameters split for tensor parallelism (``logical_axes``: ``((regex, (logical name | None per dim)),
    ...)``, mapped to mesh axes by ``jaxtrain.parallel.rules.LOGICAL_AXES``: a model never names a mesh axis).

    What only some models can do is a capability of its own (``Student``, ``Stacked``): test it with
    ``isinstance(model, Distillable)`` / ``isinstance(model, Pipelinable)``."""

    name: str
    init: Callable
    loss_fn: Callable
    eval_fn: Callable
    logits: Callable
    _: dataclasses.KW_ONLY  # what follows is named (a field added later cannot shift another's value)
    logical_axes: tuple = ()
    input_shape: tuple = IMAGE_SHAPE  # (H, W, C) of the images it was built for
    num_classes: int = 10
    classifier: str = ""  # a regex of its classifier's parameter names: what a linear probe trains
    init_name: str = "d2l"  # which of the recipe's inits made ``init``'s weights
    conv: str = "xla"  # whose convolutions its layers run: "xla", or "onednn" (jaxtrain.kernels.onednn, CPUs)

    def batch_shapes(self, batch_size: int) -> dict:
        """The shapes of a batch of ``batch_size`` (``jax.ShapeDtypeStruct``): what a step compiles for."""
        import jax
        import numpy as np

        return {"image": jax.ShapeDtypeStruct((batch_size, *self.input_shape), np.float32),
                "label": jax.ShapeDtypeStruct((batch_size,), np.int32)}

    def example_batch(self, batch_size: int, seed: int = 0) -> dict:
        """A random host batch of the model's input (images in [0, 1), labels): benchmarks and tests."""
        import numpy as np

        rng = np.random.default_rng(seed)
        return {"image": rng.random((batch_size, *self.input_shape), dtype=np.float32),
                "label": rng.integers(0, self.num_classes, batch_size).astype(np.int32)}

    def input_shapes(self, batch_size: int):
        """The shape of what ``logits`` takes for ``batch_size`` examples (a ``jax.ShapeDtypeStruct``)."""
        import jax
        import numpy as np

        return jax.ShapeDtypeStruct((batch_size, *self.input_shape), np.float32)

    def inputs(self, batch: dict):
        """What ``logits`` takes of a loader's ``batch``: its images."""
        return batch["image"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LanguageModel(Model):
    """A next-token predictor: windows of ``input_shape[0]`` (T) tokens, ``num_classes`` the vocabulary (each
    position's classes are the next token's). Its batches are ``{"tokens": int32 [B, T + 1]}``; its ``logits``
    take tokens [B, T] and give [B, T, vocabulary]. ``config``: the network's shape (``jaxtrain.models.gpt``)."""

    config: object
    stack: Stack  # its blocks, for a pipeline (``Pipelinable``; the head reads the tied embedding)

    @property
    def seq_len(self) -> int:
        return self.input_shape[0]

    def batch_shapes(self, batch_size: int) -> dict:
        import jax
        import numpy as np

        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.seq_len + 1), np.int32)}

    def example_batch(self, batch_size: int, seed: int = 0) -> dict:
        import numpy as np

        rng = np.random.default_rng(seed)
        return {"tokens": rng.integers(0, self.num_classes, (batch_size, self.seq_len + 1)).astype(np.int32)}

    def input_shapes(self, batch_size: int):
        import jax
        import numpy as np

        return jax.ShapeDtypeStruct((batch_size, self.seq_len), np.int32)

    def inputs(self, batch: dict):
        return batch["tokens"][:, :-1]


@runtime_checkable
class Distillable(Protocol):
    """A model whose loss takes another head: ``with_head(head) -> loss_fn`` whose loss is
    ``head(logits, batch) -> (loss, metrics)`` (a distillation student)."""

    def with_head(self, head: Callable) -> Callable: ...


@dataclasses.dataclass(frozen=True)
class Stack:
    """A model as ``embed -> identical layers -> head``: what a pipeline splits (``jaxtrain.train.pipeline``).
    ``head_reads_embed``: the head is tied to the embedding (the GPT's logits), its fns take ``(H, E)`` for H
    (``make_pipeline_step(..., head_reads_embed=)``, ``sequential_loss(..., head_reads_embed=)``)."""

    embed_fn: Callable  # (E, batch) -> x
    stage_fn: Callable  # (one layer's params, x) -> x
    head_loss_fn: Callable  # (H, x, batch) -> (loss, metrics)
    head_eval_fn: Callable  # (H, x, batch) -> per-example metrics
    head_reads_embed: bool = False  # the head fns take (H, E) where they take H


@runtime_checkable
class Pipelinable(Protocol):
    """A model with a ``Stack`` of identical layers: it can train pipelined over a mesh's "stage" axis."""

    stack: Stack


@dataclasses.dataclass(frozen=True, kw_only=True)
class Student(Model):
    """A registry model that can be distilled into (``Distillable``)."""

    head_loss: Callable  # head -> loss_fn

    def with_head(self, head: Callable) -> Callable:
        return self.head_loss(head)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stacked(Student):
    """A registry model that can also be pipelined (``Pipelinable``)."""

    stack: Stack
