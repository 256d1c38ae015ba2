"""Post-training int8 quantisation of a trained model, with qwix.

Weights become int8 with one float scale per output channel (symmetric,
absmax), computed once; activations become int8 with one scale per example,
computed as the model runs (dynamic quantisation, like PyTorch's
``quantize_dynamic``, but for convolutions too); every conv and dense layer
then runs an int8 x int8 -> int32 convolution / dot, rescaled to float after
(``integer_ops`` finds them in the compiled program). Biases, BatchNorm and
the rest stay in fp32.

- LeNet (params dict): its layers take their ops (``lenet.apply(..., ops=)``):
  ``jaxtrain.nn.int8.INT8_OPS`` quantise the activation and call
  ``qwix.conv_general_dilated`` / ``qwix.dot_general`` on the int8 weight
  (a ``qwix.QArray``).
- NNX models (ResNet-18): ``qwix.quantize_model`` with a ``PtqProvider``
  whose rule covers every conv and dense layer: qwix intercepts the module's
  ``lax`` calls and replaces each kernel by its int8 ``QArray``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtrain.choices import INT8_AFTER_TRAINING
from jaxtrain.core import compat
from jaxtrain.errors import ConfigError, need
qwix = need("qwix", "int8 quantisation")  # before jaxtrain.nn.int8, which needs it too
from jaxtrain.nn.int8 import INT8_OPS, int8_weight  # noqa: E402

MODELS = INT8_AFTER_TRAINING  # what ``quantize`` handles


@dataclasses.dataclass
class Quantized:
    """A trained model and its int8 version: ``fp32(images)`` and ``int8(images)`` give logits.

    ``apply(variables, images)`` is jitted; the variables are its arguments
    (not constants folded into the program)."""

    apply_fp32: Callable
    apply_int8: Callable
    fp32_variables: Any
    int8_variables: Any
    fp32_params: Any
    int8_params: Any  # kernels as qwix.QArray (int8 qvalue, float scale); the rest as trained

    def fp32(self, images):
        return self.apply_fp32(self.fp32_variables, images)

    def int8(self, images):
        return self.apply_int8(self.int8_variables, images)

    def compiled_text(self, images, which: str = "int8") -> str:
        fn, variables = (self.apply_int8, self.int8_variables) if which == "int8" else (self.apply_fp32,
                                                                                       self.fp32_variables)
        return fn.lower(variables, images).compile().as_text()

    @property
    def fp32_param_bytes(self) -> int:
        return param_bytes(self.fp32_params)

    @property
    def int8_param_bytes(self) -> int:
        return param_bytes(self.int8_params)


def param_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def quantize(meta: dict, params, model_state) -> Quantized:
    """The int8 version of a finished run's model (``jaxtrain.driver.export.load``'s output)."""
    if meta["model"] == "lenet":
        return _lenet(params)
    if meta["model"] == "resnet18":
        return _nnx_resnet(meta, params, model_state)
    raise ConfigError(f"int8 quantisation covers {', '.join(MODELS)}; this run trained {meta['model']}")


def int8_jit(fn):
    """``fn`` jitted as an int8 program: on CPU with ``compat.int8_compiler_options`` (YNNPACK's int8 kernels, not
    the training flag's Eigen, which has none; experiments.bench_int8 times both)."""
    return jax.jit(fn, compiler_options=compat.int8_compiler_options() if jax.default_backend() == "cpu" else None)


def _lenet(params) -> Quantized:
    from jaxtrain.models import lenet

    params = jax.tree.map(jnp.asarray, params)
    qparams = {name: {"w": int8_weight(p["w"]), "b": p["b"]} for name, p in params.items()}
    return Quantized(jax.jit(lenet.apply), int8_jit(lambda p, x: lenet.apply(p, x, ops=INT8_OPS)), params, qparams,
                     params, qparams)


def _nnx_resnet(meta, params, model_state) -> Quantized:
    from flax import nnx

    from jaxtrain.models import resnet

    shape, classes = tuple(meta["input_shape"]), meta["num_classes"]
    model = resnet.adapter(shape, classes, weight_init=meta.get("init", "d2l")).module(params, model_state)
    model.eval()
    rule = qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)
    qmodel = qwix.quantize_model(model, qwix.PtqProvider([rule]), jnp.zeros((1, *shape), jnp.float32))
    (graphdef, state), (qgraphdef, qstate) = nnx.split(model), nnx.split(qmodel)

    def pure_params(module):
        return nnx.to_pure_dict(nnx.split(module, nnx.Param, ...)[1])

    return Quantized(jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)),
                     int8_jit(lambda st, x: nnx.merge(qgraphdef, st)(x)), state, qstate,
                     pure_params(model), pure_params(qmodel))


def integer_ops(compiled_text: str) -> dict:
    """Integer convolutions and dots of a compiled program (HLO text): ``{"convolution": n, "dot": n, "s8": k}``,
    those with an int32 result and integer operands, ``k`` of them taking int8 operands as they are.

    XLA:CPU's defaults hand int8 convolutions and dots to YNNPACK as int8 (``k`` = all); under jaxtrain's
    training flag (``--xla_cpu_experimental_ynn_fusion_type=reduce``, convolutions to Eigen, which has no int8
    convolution) XLA widens the int8 operands to int32 first: still integer arithmetic, 4x the operand bytes.
    """
    types = dict(re.findall(r"(%[\w.-]+) = (\w+)\[", compiled_text))  # every value's element type
    found = {"convolution": 0, "dot": 0, "s8": 0}
    for out, op, operands in re.findall(r"= (\w+)\[[^\]]*\]\S* (convolution|dot)\((%[\w.-]+, %[\w.-]+)\)",
                                        compiled_text):
        kinds = {types.get(x) for x in operands.split(", ")}
        if out == "s32" and kinds <= {"s8", "s32"}:
            found[op] += 1
            found["s8"] += kinds == {"s8"}
    return found
