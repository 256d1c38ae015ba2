"""The previous, linen ResNet-18 (test reference only): the NNX model must compute what it computed.

3x3 stem (64 channels, stride 1, BatchNorm, ReLU; no max-pool), 4 stages of
2 residual blocks (64, 128, 256, 512 channels; the first block of stages 2-4
halves the resolution with stride 2 and a 1x1 conv shortcut), global average
pool, dense 10. Convs have biases, as in d2l; Linear/Conv weights ~ N(0, 0.01^2)
(d2l's ``init_weights``) or He-normal (``weight_init="he"``).

BatchNorm statistics live in the ``batch_stats`` collection (the step's
``model_state``). In training they are computed over the GLOBAL (micro-)batch
under every strategy without the model knowing which: ``jt.step_context().batch_axis``
names the axis the step splits the batch over while it is traced (None
under "jit", where the batch axis is global anyway), and BatchNorm averages
its statistics over it (a synchronised BatchNorm). Evaluation uses the
running averages.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.core.remat import policy as remat_policy
from jaxtrain.models import classify
from jaxtrain.parallel.devices import MODEL_AXIS

NUM_CLASSES = 10
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (channels, stride of the first block)


# Tensor parallelism over "model": every conv's output channels (kernel HWIO: O; and its bias), and the
# classifier's input features; BatchNorm parameters and statistics stay replicated.
TP_RULES = ((r"Conv_\d+/kernel$", P(None, None, None, MODEL_AXIS)), (r"Conv_\d+/bias$", P(MODEL_AXIS)),
            (r"Dense_0/kernel$", P(MODEL_AXIS, None)))


def _kernel_init(init: str):
    if init == "d2l":
        return nn.initializers.normal(stddev=0.01)
    if init == "he":
        return nn.initializers.he_normal()
    raise ValueError(f"unknown init {init!r}: use d2l or he")


def _batch_axis() -> str | None:
    """The axis the train step splits the batch over (None outside a step, or where the loss sees it whole)."""
    ctx = jt.step_context()
    return ctx.batch_axis if ctx is not None else None


def _batch_norm(train: bool) -> nn.BatchNorm:
    """d2l's BatchNorm (momentum 0.9, eps 1e-5), its statistics synchronised over the devices in training.

    Two-pass variance (mean first, then the mean squared deviation), not
    flax's fast E[x^2] - E[x]^2: on a CPU without AVX-512 (jax 0.10.2) the
    fast form's cancellation made the 2-device step's stem-conv gradient off
    by 1e-3 (relative, vs a float64 reference) while 1 device was at 2e-6;
    two passes put both at 2e-6. It costs one more pass over each activation.
    """
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                        axis_name=_batch_axis() if train else None, use_fast_variance=False)


class Residual(nn.Module):
    """d2l's Residual: conv-BN-ReLU-conv-BN, plus a (1x1 conv) shortcut, then ReLU."""

    channels: int
    strides: int = 1
    projection: bool = False
    weight_init: str = "d2l"

    @nn.compact
    def __call__(self, x, train: bool):
        conv = partial(nn.Conv, kernel_init=_kernel_init(self.weight_init))
        norm = partial(_batch_norm, train)
        y = conv(self.channels, (3, 3), strides=self.strides, padding=1)(x)
        y = nn.relu(norm()(y))
        y = norm()(conv(self.channels, (3, 3), padding=1)(y))
        if self.projection:
            x = conv(self.channels, (1, 1), strides=self.strides)(x)
        return nn.relu(y + x)


class ResNet18(nn.Module):
    num_classes: int = NUM_CLASSES
    weight_init: str = "d2l"
    remat: str = "none"  # a jaxtrain.core.remat policy name, applied per residual block

    @nn.compact
    def __call__(self, x, train: bool = False):
        kinit = _kernel_init(self.weight_init)
        x = nn.Conv(64, (3, 3), padding=1, kernel_init=kinit)(x)
        x = _batch_norm(train)(x)
        x = nn.relu(x)
        block = Residual
        pol = remat_policy(self.remat)
        if pol is not None:
            block = nn.remat(Residual, policy=pol, static_argnums=(2,))  # arg 2 = train
        for stage, (channels, strides) in enumerate(STAGES):
            for i in range(2):
                first = i == 0 and stage > 0
                # Explicit names: the remat'd class would otherwise name its
                # params differently, and params must not depend on --remat.
                x = block(channels, strides if first else 1, projection=first, weight_init=self.weight_init,
                          name=f"Residual_{2 * stage + i}")(x, train)
        x = x.mean(axis=(1, 2))  # global average pool
        return nn.Dense(self.num_classes, kernel_init=kinit)(x)


def init_variables(rng: jax.Array, model: ResNet18 | None = None, input_shape=(28, 28, 1)) -> tuple[dict, dict]:
    """(params, batch_stats) for images of ``input_shape`` (H, W, C)."""
    model = model or ResNet18()
    variables = model.init(rng, jnp.zeros((1, *input_shape), jnp.float32), train=False)
    return variables["params"], variables["batch_stats"]


def make_loss_fn(model: ResNet18):
    """Softmax cross-entropy in fp32; BatchNorm statistics are the model state."""

    def loss_fn(params, batch_stats, batch, rng):
        del rng
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, batch["image"], train=True,
                                      mutable=["batch_stats"])
        loss, metrics = classify.mean_loss(logits, batch["label"])
        return loss, (updates["batch_stats"], metrics)

    return loss_fn


def make_eval_fn(model: ResNet18):
    """Per-example metrics with the running BatchNorm statistics."""

    def eval_fn(params, batch_stats, batch):
        logits = model.apply({"params": params, "batch_stats": batch_stats}, batch["image"], train=False)
        return classify.per_example(logits, batch["label"])

    return eval_fn

