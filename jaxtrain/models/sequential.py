"""A stack of identical layers as one model: ``embed -> L layers -> head``, the shape a pipeline splits.

``params = {"embed": E, "stages": S, "head": H}``, every ``S`` leaf stacking the L layers on its leading
axis. ``sequential_loss`` runs the layers in order (a scan): the plain model, and the reference a
pipelined step (``jaxtrain.train.pipeline``) is tested against. ``head_reads_embed``: the head is tied to the
embedding (a language model's logits ``x @ E["wte"].T``) and ``head_loss_fn`` takes ``(H, E)`` for ``H``; E's
gradient is then the sum of its two uses, as the pipeline's is.
"""

from __future__ import annotations

from jax import lax


def sequential_loss(embed_fn, stage_fn, head_loss_fn, head_reads_embed: bool = False):
    """The plain model as a ``loss_fn`` for ``make_train_step`` (params["stages"] leaves ``[L, ...]``)."""

    def loss_fn(params, model_state, batch, rng):
        x = embed_fn(params["embed"], batch)
        x = lax.scan(lambda x, p: (stage_fn(p, x), None), x, params["stages"])[0]
        head = (params["head"], params["embed"]) if head_reads_embed else params["head"]
        loss, metrics = head_loss_fn(head, x, batch)
        return loss, (model_state, metrics)

    return loss_fn
