"""Model FLOPs: what a model's forward pass computes per example, counted from its layers' shapes.

    from jaxtrain.models import flops
    flops.forward("resnet50", input_shape=(224, 224, 3), num_classes=1000)   # ~8.2e9 (4.1 G multiply-adds)

Each convolution counts 2 x (output elements) x (kernel height x width x input channels per group), each matrix
product (dense layers, attention's scores and values) 2 x (output elements) x (contracted size): read from the
forward's jaxpr (every ``conv_general_dilated`` and ``dot_general``, inside jit, remat, custom derivatives and
scans), so the count follows the layers as built, never a table kept by hand. Elementwise work, normalisation
and pooling are left out, as PaLM's definition of model FLOPs does.

Training MFU (model FLOPs utilisation) = 3 x forward FLOPs x examples/s / peak: the backward pass is twice the
forward, counted once whatever the step recomputes. The compiled program's FLOPs over the peak is HFU (hardware
FLOPs utilisation): under remat it rises while the step gets slower; MFU does not.
"""

from __future__ import annotations

import functools
import math

TRAIN_FACTOR = 3  # forward + backward (2x: gradients of the activations and of the weights)


def _dot(eqn) -> float:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)


def _conv(eqn) -> float:
    rhs = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
    per_output = rhs[spec[1]] * math.prod(rhs[d] for d in spec[2:])
    return 2 * math.prod(eqn.outvars[0].aval.shape) * per_output


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def count(jaxpr) -> float:
    """The convolution and matrix-product FLOPs of one evaluation of ``jaxpr`` (a Jaxpr or ClosedJaxpr)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot(eqn)
        elif name == "conv_general_dilated":
            total += _conv(eqn)
        elif name == "cond":  # one branch runs: the costliest one counted
            total += max(count(b) for b in eqn.params["branches"])
        elif name == "while":
            raise ValueError("a while loop in the forward pass: its trip count is not known from the shapes")
        else:
            inner = sum(count(j) for v in eqn.params.values() for j in _sub_jaxprs(v))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


@functools.cache
def forward(name: str, input_shape: tuple, num_classes: int, size: str | None = None) -> float:
    """Forward FLOPs per example of model ``name`` for images of ``input_shape`` and ``num_classes`` classes
    (a language model's: windows of ``input_shape[0]`` tokens, a vocabulary of ``num_classes``, its ``size``)
    (its plain version: XLA's convolutions, jnp kernels, no remat, which do not change what it computes)."""
    import jax

    from jaxtrain.models import registry

    model = registry.get(name, input_shape=tuple(input_shape), num_classes=num_classes, conv="xla", size=size)
    params, model_state = jax.eval_shape(model.init, jax.random.key(0))
    batch = 2  # divided out below; 2, not 1, so that nothing specialises a batch of one away
    return count(jax.make_jaxpr(model.logits)(params, model_state, model.input_shapes(batch))) / batch


def utilisation(model_flops_per_example: float | None, compiled_flops_per_step: float | None, examples: int,
                seconds: float, peak: float | None) -> dict:
    """``{"mfu", "hfu"}`` of a step of ``examples`` taking ``seconds`` on devices of total dense ``peak``
    FLOP/s: model FLOPs (x3 for training) and the compiled program's, over the peak; None where unknown."""
    ok = peak and seconds > 0
    mfu = TRAIN_FACTOR * model_flops_per_example * examples / seconds / peak if ok and model_flops_per_example else None
    hfu = compiled_flops_per_step / seconds / peak if ok and compiled_flops_per_step else None
    return {"mfu": mfu, "hfu": hfu}
