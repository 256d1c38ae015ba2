"""ResNet-50 v1.5 as a Flax NNX module: the network of NVIDIA's DeepLearningExamples benchmarks (ImageNet,
224x224x3, 1000 classes), trained through ``jt.from_nnx`` with synchronised BatchNorm as ResNet-18 is.

7x7 stem (64 channels, stride 2, no bias, BatchNorm, ReLU), 3x3 max-pool (stride 2), 4 stages of 3, 4, 6 and
3 bottleneck blocks (1x1 -> 3x3 -> 1x1 convs of width 64, 128, 256, 512, output 4x the width). v1.5: the first
block of stages 2-4 halves the resolution in its 3x3 conv (v1 did it in the first 1x1), and its shortcut is a
1x1 conv with stride and BatchNorm. Global average pool, dense classifier. Convs have no bias (BatchNorm
follows); He-normal weights; each block's last BatchNorm scale starts at 0 (``zero_init_residual``, as
DeepLearningExamples trains it). BatchNorm: momentum 0.9, eps 1e-5, two-pass variance, the running variance
updated with the batch's unbiased variance as PyTorch's is (``resnet.batch_norm``): torchvision's resnet50, its
[0, 1] inputs normalised with ImageNet's mean and std first (``inputs.imagenet_normalized``).
"""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx
from jax import lax

from jaxtrain.core.remat import policy as remat_policy
from jaxtrain.models import classify
from jaxtrain.models.inputs import checked_images, imagenet_normalized
from jaxtrain.models.resnet import batch_norm
from jaxtrain.nn.flax_nnx import from_nnx

STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # (width, blocks, stride of the first block)
EXPANSION = 4
INPUT_SHAPE = (224, 224, 3)
NUM_CLASSES = 1000

# Tensor parallelism splits each conv's output channels (as ResNet-18's rules do).
LOGICAL_AXES = ((r"(conv\d|shortcut|stem)/kernel$", (None, None, "conv_in", "conv_out")),
                (r"dense/kernel$", ("conv_out", "classes")))


class Bottleneck(nnx.Module):
    def __init__(self, cin: int, width: int, strides: int, rngs: nnx.Rngs, conv_op=lax.conv_general_dilated):
        conv = partial(nnx.Conv, use_bias=False, kernel_init=nnx.initializers.he_normal(),
                       conv_general_dilated=conv_op, rngs=rngs)
        out = width * EXPANSION
        self.conv1, self.bn1 = conv(cin, width, (1, 1)), batch_norm(width, rngs, unbiased=True)
        self.conv2 = conv(width, width, (3, 3), strides=strides, padding=1)
        self.bn2 = batch_norm(width, rngs, unbiased=True)
        self.conv3, self.bn3 = conv(width, out, (1, 1)), batch_norm(out, rngs, unbiased=True)
        self.bn3.scale[...] = self.bn3.scale[...] * 0  # zero_init_residual
        projection = strides != 1 or cin != out
        self.shortcut = conv(cin, out, (1, 1), strides=strides) if projection else None
        self.bn_shortcut = batch_norm(out, rngs, unbiased=True) if projection else None

    def __call__(self, x, train: bool):
        avg = not train
        y = nnx.relu(self.bn1(self.conv1(x), use_running_average=avg))
        y = nnx.relu(self.bn2(self.conv2(y), use_running_average=avg))
        y = self.bn3(self.conv3(y), use_running_average=avg)
        skip = x if self.shortcut is None else self.bn_shortcut(self.shortcut(x), use_running_average=avg)
        return nnx.relu(y + skip)


class ResNet50(nnx.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = NUM_CLASSES, *, remat: str = "none",
                 conv=lax.conv_general_dilated, rngs: nnx.Rngs):
        """``conv``: the convolution every layer runs (as ResNet-18's)."""
        self.stem = nnx.Conv(in_channels, 64, (7, 7), strides=2, padding=3, use_bias=False,
                             kernel_init=nnx.initializers.he_normal(), conv_general_dilated=conv, rngs=rngs)
        self.bn = batch_norm(64, rngs, unbiased=True)
        blocks, cin = [], 64
        for width, count, strides in STAGES:
            for i in range(count):
                blocks.append(Bottleneck(cin, width, strides if i == 0 else 1, rngs, conv))
                cin = width * EXPANSION
        self.blocks = nnx.List(blocks)
        self.dense = nnx.Linear(cin, num_classes, kernel_init=nnx.initializers.he_normal(), rngs=rngs)
        self.remat = remat  # a jaxtrain.core.remat policy name, applied per bottleneck block

    def __call__(self, x, train: bool = False):
        x = imagenet_normalized(checked_images(x, self.stem.in_features, "ResNet-50", self.stem.kernel.dtype))
        x = nnx.relu(self.bn(self.stem(x), use_running_average=not train))
        x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        pol = remat_policy(self.remat)
        for block in self.blocks:
            x = (nnx.remat(Bottleneck.__call__, policy=pol, static_argnums=(2,)) if pol is not None
                 else Bottleneck.__call__)(block, x, train)
        return self.dense(x.mean(axis=(1, 2)))


def adapter(input_shape=INPUT_SHAPE, num_classes: int = NUM_CLASSES, remat: str = "none",
            head=classify.label_loss, conv=lax.conv_general_dilated):
    """``jt.from_nnx`` of an abstract ResNet-50 (no weights made); ``conv``: its layers' convolution."""
    model = nnx.eval_shape(lambda: ResNet50(input_shape[-1], num_classes, remat=remat, conv=conv,
                                            rngs=nnx.Rngs(0)))
    return from_nnx(model, loss=head,
                    per_example=lambda logits, batch: classify.per_example(logits, batch["label"]))


def init_variables(rng: jax.Array, input_shape=INPUT_SHAPE, num_classes: int = NUM_CLASSES) -> tuple[dict, dict]:
    """(params, batch_stats) as plain dicts."""
    model = ResNet50(input_shape[-1], num_classes, rngs=nnx.Rngs(rng))
    _, params, _, stats = nnx.split(model, nnx.Param, nnx.RngState, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(stats)
