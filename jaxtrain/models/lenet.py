"""The d2l LeNet from scratch: a plain function over a params dict."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.core.remat import remat as _remat
from jaxtrain.models import classify
from jaxtrain.models.inputs import checked_images

NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)


def shapes(input_shape=IMAGE_SHAPE, num_classes: int = NUM_CLASSES) -> dict:
    """(name -> (weight shape, bias shape)): convs HWIO, inputs NHWC; 28x28x1 gives d2l's 800 features."""
    h, w, c = input_shape

    def side(n):  # conv 3 valid, pool 2, conv 5 valid, pool 2
        return ((n - 2) // 2 - 4) // 2

    if side(h) < 1 or side(w) < 1:
        raise ValueError(f"LeNet needs images of at least 14x14, got {h}x{w}")
    return {"conv1": ((3, 3, c, 20), (20,)), "conv2": ((5, 5, 20, 50), (50,)),
            "dense1": ((side(h) * side(w) * 50, 128), (128,)), "dense2": ((128, num_classes), (num_classes,))}


# Logical axes (jaxtrain.parallel.rules.LOGICAL_AXES maps them to the mesh): tensor parallelism splits "mlp", the
# hidden layer (Megatron's MLP split): dense1 column-parallel (its outputs split), dense2 row-parallel (its
# inputs split); XLA adds the one all-reduce of dense2's partial sums. Convs stay replicated.
LOGICAL_AXES = ((r"dense1/w$", ("embed", "mlp")), (r"dense1/b$", ("mlp",)), (r"dense2/w$", ("mlp", "classes")))


def init_params(rng: jax.Array, scale: float = 0.01, input_shape=IMAGE_SHAPE, num_classes: int = NUM_CLASSES) -> dict:
    """d2l's init: weights ~ N(0, 1) * scale, biases 0."""
    layers = shapes(input_shape, num_classes)
    keys = jax.random.split(rng, len(layers))
    return {
        name: {"w": scale * jax.random.normal(k, w_shape, jnp.float32), "b": jnp.zeros(b_shape, jnp.float32)}
        for k, (name, (w_shape, b_shape)) in zip(keys, layers.items())
    }


FLOAT_OPS = (lax.conv_general_dilated, jnp.matmul)  # (conv, matmul): jaxtrain.analysis.quantize swaps in int8 ones


def _conv(x, p, conv=lax.conv_general_dilated):
    y = conv(x, p["w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + p["b"]


def _avg_pool2(x):
    """2x2 average pool, stride 2, floor on odd sizes (9 -> 4) like d2l's."""
    b, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


def _conv_block(p, x, conv=lax.conv_general_dilated):
    return _avg_pool2(jax.nn.relu(_conv(x, p, conv)))


def apply(params: dict, images: jax.Array, remat: str = "none", ops: tuple = FLOAT_OPS) -> jax.Array:
    """Logits [B, classes] for images [B, H, W, C]; ``remat`` names a policy per conv block; ``ops``: the
    (conv, matmul) the layers use."""
    conv, matmul = ops
    images = checked_images(images, params["conv1"]["w"].shape[2], "LeNet", params["conv1"]["w"].dtype)
    block = _remat(functools.partial(_conv_block, conv=conv), remat)
    x = block(params["conv1"], images)  # 28 -> 26 -> 13
    x = block(params["conv2"], x)  # 13 -> 9 -> 4
    x = x.reshape(x.shape[0], -1)  # 4*4*50 = 800 for 28x28
    x = jax.nn.relu(matmul(x, params["dense1"]["w"]) + params["dense1"]["b"])
    return matmul(x, params["dense2"]["w"]) + params["dense2"]["b"]


def make_loss_fn(remat: str = "none", head=classify.label_loss, ops: tuple = FLOAT_OPS):
    """The train-step contract of jaxtrain; ``head(logits, batch) -> (loss, metrics)``: softmax cross-entropy
    (logits in fp32) unless told otherwise (distillation's); ``ops``: the layers' (conv, matmul)."""

    def loss_fn(params, model_state, batch, rng):
        del rng
        loss, metrics = head(apply(params, batch["image"], remat, ops), batch)
        return loss, (model_state, metrics)

    return loss_fn


loss_fn = make_loss_fn()


def make_eval_fn(ops: tuple = FLOAT_OPS):
    def eval_fn(params, model_state, batch):
        """Per-example metrics; the eval-step contract (masked and summed there)."""
        del model_state
        return classify.per_example(apply(params, batch["image"], ops=ops), batch["label"])

    return eval_fn


eval_fn = make_eval_fn()
