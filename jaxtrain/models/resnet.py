"""d2l's ResNet-18 as a Flax NNX module, with synchronised BatchNorm; trained through ``jt.from_nnx``.

3x3 stem (64 channels, stride 1, BatchNorm, ReLU; no max-pool), 4 stages of
2 residual blocks (64, 128, 256, 512 channels; the first block of stages 2-4
halves the resolution with stride 2 and a 1x1 conv shortcut), global average
pool, dense classifier. Convs have biases, as in d2l; conv and dense weights
~ N(0, 0.01^2) (d2l's ``init_weights``) or He-normal (``weight_init="he"``).
Any input size and channel count (28x28x1 Fashion-MNIST, 32x32x3 CIFAR-10).

BatchNorm statistics (``nnx.BatchStat``) are the step's ``model_state``. In
training they are computed over the GLOBAL (micro-)batch under every
strategy without the model knowing which: ``from_nnx`` sets each
BatchNorm's ``axis_name`` to the step's batch axis (``jt.step_context()``) while the step is traced
(a synchronised BatchNorm). Evaluation uses the running averages.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxtrain.core.remat import materialize, policy as remat_policy
from jaxtrain.models import classify
from jaxtrain.models.inputs import checked_images, imagenet_normalized
from jaxtrain.nn.batch_stats import moments, split
from jaxtrain.nn.flax_nnx import from_nnx

NUM_CLASSES = 10
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (channels, stride of the first block)
STEMS = ("d2l", "imagenet")

# Logical axes (jaxtrain.parallel.rules.LOGICAL_AXES maps them to the mesh): tensor parallelism splits every conv's
# output channels ("conv_out": kernel HWIO's O, and its bias) and so the classifier's input features;
# BatchNorm parameters and statistics stay replicated.
LOGICAL_AXES = ((r"(conv\d?|shortcut)/kernel$", (None, None, "conv_in", "conv_out")),
                (r"(conv\d?|shortcut)/bias$", ("conv_out",)), (r"dense/kernel$", ("conv_out", "classes")))


def _kernel_init(init: str):
    if init == "d2l":
        return nnx.initializers.normal(stddev=0.01)
    if init == "he":
        return nnx.initializers.he_normal()
    raise ValueError(f"unknown init {init!r}: use d2l or he")


class BatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` (features last) whose batch statistics, where a train step splits the batch over
    devices, are ``jaxtrain.nn.batch_stats.moments``' (one collective each way, two-pass; flax's synchronised
    statistics take two each way; elsewhere flax's, the same two passes), and whose output keeps its input's
    dtype: statistics and normalisation in f32, but under a bf16 / fp16
    policy the next conv gets a bf16 / fp16 input. (flax's own returns f32 there, the f32 batch statistics
    promoting it, so every later conv ran in f32: the estimate of the compiled A100 program found 156 of
    ResNet-50's 158 cuDNN convolutions in f32.) Evaluation (running averages) is flax's; ``stats="flax"``:
    flax's synchronised statistics in training too (what tests calibrated on their rounding compare)."""

    def __init__(self, *args, stats: str = "jaxtrain", unbiased: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if stats not in ("jaxtrain", "flax"):
            raise ValueError(f"unknown batch statistics {stats!r}: use jaxtrain or flax")
        self.stats = stats
        self.unbiased = unbiased  # the running variance takes the batch's unbiased variance (PyTorch's BatchNorm)

    def _count(self, x, axes):
        """Examples x positions a channel's statistics are over: this device's count times the devices' (at
        least 2: one value has no unbiased variance)."""
        devices = 1 if self.axis_name is None else lax.psum(1, self.axis_name)
        return jnp.maximum(math.prod(x.shape[a] for a in axes) * devices, 2)

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        running = self.use_running_average if use_running_average is None else use_running_average
        axes = tuple(range(x.ndim - 1))
        if (running or mask is not None or self.axis_index_groups is not None or self.stats == "flax"
                or not split(x, axes, self.axis_name)):
            before = self.var[...]
            y = super().__call__(x, use_running_average, mask=mask).astype(x.dtype)
            if self.unbiased and not running and mask is None:  # flax's update took the biased variance v:
                # new = m old + (1 - m) v, so the unbiased one adds (1 - m) v / (n - 1) = (new - m old) / (n - 1)
                new = self.var[...]
                self.var[...] = lax.stop_gradient(new + (new - self.momentum * before) / (self._count(x, axes) - 1))
            return y
        h = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean, var = moments(h, axes, self.axis_name)
        self.mean[...] = lax.stop_gradient(self.momentum * self.mean[...] + (1 - self.momentum) * mean)
        running_var = var
        if self.unbiased:
            count = self._count(x, axes)
            running_var = var * (count / (count - 1))
        self.var[...] = lax.stop_gradient(self.momentum * self.var[...] + (1 - self.momentum) * running_var)
        mul = lax.rsqrt(var + self.epsilon)  # flax's _normalize, in its order
        mul = mul if self.scale is None else mul * self.scale[...]
        y = (h - mean) * mul
        return (y if self.bias is None else y + self.bias[...]).astype(x.dtype)


def batch_norm(channels: int, rngs: nnx.Rngs, stats: str = "jaxtrain", unbiased: bool = False) -> nnx.BatchNorm:
    """d2l's BatchNorm (momentum 0.9, eps 1e-5), its output in its input's dtype (``BatchNorm``).

    Two-pass variance (mean first, then the mean squared deviation; ``BatchNorm``'s training statistics
    are, and ``use_fast_variance=False`` says so to flax's evaluation path), not
    flax's fast E[x^2] - E[x]^2: on a CPU without AVX-512 (jax 0.10.2) the
    fast form's cancellation made the 2-device step's stem-conv gradient off
    by 1e-3 (relative, vs a float64 reference) while 1 device was at 2e-6;
    two passes put both at 2e-6. ``unbiased``: the running variance takes the batch's unbiased variance, as
    PyTorch's BatchNorm does (torchvision's networks: ``stem="imagenet"``, ResNet-50).
    """
    return BatchNorm(channels, momentum=0.9, epsilon=1e-5, use_fast_variance=False, stats=stats, unbiased=unbiased,
                     rngs=rngs)


class Residual(nnx.Module):
    """d2l's Residual: conv-BN-ReLU-conv-BN, plus a (1x1 conv) shortcut, then ReLU. ``imagenet``: torchvision's
    BasicBlock (convs without biases, the shortcut conv followed by a BatchNorm)."""

    def __init__(self, cin: int, channels: int, strides: int, projection: bool, init: str, rngs: nnx.Rngs,
                 conv_op=lax.conv_general_dilated, stats: str = "jaxtrain", imagenet: bool = False):
        conv = partial(nnx.Conv, kernel_init=_kernel_init(init), conv_general_dilated=conv_op, use_bias=not imagenet,
                       rngs=rngs)
        self.conv1 = conv(cin, channels, (3, 3), strides=strides, padding=1)
        self.bn1 = batch_norm(channels, rngs, stats, imagenet)
        self.conv2 = conv(channels, channels, (3, 3), padding=1)
        self.bn2 = batch_norm(channels, rngs, stats, imagenet)
        self.shortcut = conv(cin, channels, (1, 1), strides=strides) if projection else None
        self.bn_shortcut = batch_norm(channels, rngs, stats, imagenet) if projection and imagenet else None

    def __call__(self, x, train: bool):
        # The convs' inputs stored once: on a CPU, XLA otherwise recomputes each from the conv outputs before it
        # inside the relayout for its weight gradient, up to ~10x slower (remat.materialize).
        x = materialize(x)
        y = materialize(nnx.relu(self.bn1(self.conv1(x), use_running_average=not train)))
        y = self.bn2(self.conv2(y), use_running_average=not train)
        skip = x if self.shortcut is None else self.shortcut(x)
        if self.bn_shortcut is not None:
            skip = self.bn_shortcut(skip, use_running_average=not train)
        return nnx.relu(y + skip)


class ResNet18(nnx.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = NUM_CLASSES, *, weight_init: str = "d2l",
                 remat: str = "none", conv=lax.conv_general_dilated, batch_stats: str = "jaxtrain",
                 stem: str = "d2l", rngs: nnx.Rngs):
        """``conv``: the convolution every layer runs (``lax.conv_general_dilated``'s signature; e.g.
        ``jaxtrain.kernels.onednn.conv_general_dilated``); ``batch_stats``: its BatchNorms' (``BatchNorm``);
        ``stem``: "d2l" (above), or "imagenet": torchvision's ResNet-18 (7x7 stride-2 stem and a 3x3 stride-2
        max-pool, convs without biases, BatchNorm after each shortcut conv) for 224x224 images, its [0, 1]
        inputs normalised with ImageNet's mean and std first (``inputs.imagenet_normalized``), as
        torchvision's transforms feed it."""
        if stem not in STEMS:
            raise ValueError(f"unknown stem {stem!r}: use {' or '.join(STEMS)}")
        imagenet = stem == "imagenet"
        self.conv = nnx.Conv(in_channels, 64, (7, 7) if imagenet else (3, 3), strides=2 if imagenet else 1,
                             padding=3 if imagenet else 1, use_bias=not imagenet,
                             kernel_init=_kernel_init(weight_init), conv_general_dilated=conv, rngs=rngs)
        self.bn = batch_norm(64, rngs, batch_stats, imagenet)
        blocks, cin = [], 64
        for stage, (channels, strides) in enumerate(STAGES):
            for i in range(2):
                first = i == 0 and stage > 0
                blocks.append(Residual(cin, channels, strides if first else 1, first, weight_init, rngs, conv,
                                       batch_stats, imagenet))
                cin = channels
        self.blocks = nnx.List(blocks)
        self.dense = nnx.Linear(512, num_classes, kernel_init=_kernel_init(weight_init), rngs=rngs)
        self.remat = remat  # a jaxtrain.core.remat policy name, applied per residual block
        self.max_pool = imagenet

    def __call__(self, x, train: bool = False):
        x = checked_images(x, self.conv.in_features, "ResNet-18", self.conv.kernel.dtype)
        if self.max_pool:  # torchvision's network: its inputs normalised as torchvision's transforms do
            x = imagenet_normalized(x)
        x = nnx.relu(self.bn(self.conv(x), use_running_average=not train))
        if self.max_pool:
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        pol = remat_policy(self.remat)
        for block in self.blocks:
            x = (nnx.remat(Residual.__call__, policy=pol, static_argnums=(2,)) if pol is not None
                 else Residual.__call__)(block, x, train)
        return self.dense(x.mean(axis=(1, 2)))  # global average pool


def adapter(input_shape=(28, 28, 1), num_classes: int = NUM_CLASSES, weight_init: str = "d2l", remat: str = "none",
            head=classify.label_loss, conv=lax.conv_general_dilated, batch_stats: str = "jaxtrain", stem: str = "d2l"):
    """``jt.from_nnx`` of an abstract ResNet-18 (no weights made): the loss / eval fns and the state's layout;
    ``head(logits, batch) -> (loss, metrics)``; ``conv``: its layers' convolution; ``batch_stats``: ``BatchNorm``'s;
    ``stem``: ``ResNet18``'s."""
    model = nnx.eval_shape(lambda: ResNet18(input_shape[-1], num_classes, weight_init=weight_init, remat=remat,
                                            conv=conv, batch_stats=batch_stats, stem=stem, rngs=nnx.Rngs(0)))
    return from_nnx(model, loss=head,
                    per_example=lambda logits, batch: classify.per_example(logits, batch["label"]))


def init_variables(rng: jax.Array, input_shape=(28, 28, 1), num_classes: int = NUM_CLASSES,
                   weight_init: str = "d2l", stem: str = "d2l") -> tuple[dict, dict]:
    """(params, batch_stats) as plain dicts: what ``adapter().loss_fn`` takes."""
    model = ResNet18(input_shape[-1], num_classes, weight_init=weight_init, stem=stem, rngs=nnx.Rngs(rng))
    _, params, _, stats = nnx.split(model, nnx.Param, nnx.RngState, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(stats)


def apply(params: dict, batch_stats: dict, images: jax.Array, train: bool = False) -> jax.Array:
    """Logits of the model with these variables (evaluation mode by default)."""
    net = adapter(images.shape[1:], params["dense"]["kernel"].shape[-1])
    return net.module(params, batch_stats)(jnp.asarray(images), train=train)
