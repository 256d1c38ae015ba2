"""The model registry: each model's recipe (``MODELS``) and ``get(name)`` -> the ``Model`` every experiment and
benchmark trains.

No JAX at import time (the command line parses flags first); ``get`` imports it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jaxtrain.choices import INT8_AFTER_TRAINING, KJV
from jaxtrain.models.model import IMAGE_SHAPE, LanguageModel, Model, Stack, Stacked, Student


@dataclasses.dataclass(frozen=True)
class Defaults:
    """A model's recipe: what its experiment trains with unless told otherwise."""

    epochs: int
    batch_size: int
    lr: float
    inits: tuple[str, ...] = ("d2l",)  # weight inits it offers; the first is the default
    description: str = ""
    optimizer: str = "sgd"
    schedule: str = "constant"  # learning rate over the run (jaxtrain.core.optim.make_schedule)
    warmup_epochs: float = 0.0
    image_size: int = 32  # an image folder's images are resized to this (the CIFAR recipes' 32)
    folder_augment: str = "none"  # an image folder's training augmentation unless told
    revision: int = 1  # raised when the same name computes something else: older runs are refused, not misread
    revised: str = ""  # what the newest revision changed (the refusal says it)
    side_multiple: int = 1  # image sides must be multiples of this (a ViT's patch)
    text: bool = False  # a language model: trains on text:PATH (jaxtrain.data.text), not on images
    dataset: str = "fashion_mnist"  # what it trains on unless told


# name -> the recipe (d2l's "Multiple GPUs" lessons: LeNet lr 0.2, ResNet-18 lr 0.1; 10 epochs, batch 256)
MODELS = {
    "lenet": Defaults(10, 256, 0.2, description="d2l's LeNet (ReLU, average pooling), weights ~ N(0, 0.01^2)"),
    "resnet18": Defaults(10, 256, 0.1, inits=("d2l", "he"),
                         description="d2l's ResNet-18 for 28x28 (3x3 stem, no max-pool), BatchNorm synchronised "
                                     "over the devices"),
    "resnet18_imagenet": Defaults(90, 256, 0.1, inits=("he",), optimizer="momentum", schedule="warmup_cosine",
                                  warmup_epochs=2, image_size=224, folder_augment="rrc+flip",
                                  description="torchvision's ResNet-18 (7x7 stem, max-pool, no conv biases; 224x224): "
                                              "the network of torchvision's and timm's resnet18 weights"),
    "resnet50": Defaults(90, 256, 0.256, inits=("he",), optimizer="momentum", schedule="warmup_cosine",
                         warmup_epochs=2, image_size=224, folder_augment="rrc+flip", revision=2,
                         revised="its inputs normalised with ImageNet's mean and std, and its BatchNorm running "
                                 "variance unbiased, as torchvision's resnet50",
                         description="ResNet-50 v1.5 (NVIDIA DeepLearningExamples' ImageNet network; 224x224x3, 1000 "
                                     "classes for GPU plans): bottleneck blocks, BatchNorm synchronised"),
    "vit": Defaults(3, 64, 2e-3, inits=("glorot",), optimizer="adam", schedule="warmup_cosine", warmup_epochs=0.5,
                    description="a small Vision Transformer (4x4 patches, 8 pre-norm blocks of width 64): trains "
                                "unpipelined or pipelined (--mesh stage=N --microbatches M)"),
    **{f"vit_{size}": Defaults(10, 64, 1e-4, inits=("glorot",), optimizer="adam", schedule="warmup_cosine",
                               warmup_epochs=1, image_size=224, folder_augment="rrc+flip", side_multiple=16,
                               description=f"timm's vit_{size}_patch16_224 (Hugging Face's ViT-{size.title()}/16): "
                                           f"16x16 patches, width {width}, 12 blocks, a class token, exact GELU; "
                                           "the network of their pretrained weights (--init-from)")
       for size, width in (("tiny", 192), ("small", 384), ("base", 768))},
    "gpt": Defaults(1, 32, 1e-3, inits=("gpt2",), optimizer="adamw", schedule="warmup_cosine", warmup_epochs=0.1,
                    text=True, dataset=f"text:{KJV}",
                    description="a GPT (GPT-2's decoder: pre-LayerNorm blocks, causal attention, GELU MLP, tied "
                                "embeddings, learned positions or --rotary ones) trained on text:PATH; --model-size "
                                "mini (CPU-sized) to 774m (GPT-2 large)"),
}
LANGUAGE_MODELS = tuple(n for n, d in MODELS.items() if d.text)
DEFAULT_SIZE = "mini"  # a language model's --model-size unless told (jaxtrain.models.gpt.SIZES)


def names(side: int | None = None) -> tuple[str, ...]:
    """The registry's models; ``side``: those that take images of that side (28: Fashion-MNIST's)."""
    return tuple(n for n, d in MODELS.items() if not d.text and (side is None or side % d.side_multiple == 0))


def get(name: str, *, remat: str = "none", init: str | None = None, input_shape: tuple = IMAGE_SHAPE,
        num_classes: int = 10, quantize: str = "none", kernels: str = "jnp", conv: str = "auto",
        size: str | None = None, device=None, unroll: bool | None = None, rotary: bool = False) -> Model:
    """The named model for images of ``input_shape`` (H, W, C) and ``num_classes`` classes (the dataset's), its
    train-mode loss remat'ed per block by the ``remat`` policy; ``quantize="int8"``: quantisation-aware (its
    convs and dense layers see int8-rounded weights and activations, gradients straight through);
    ``kernels="pallas"``: its train loss's cross-entropy (and the ViT's layer norms) are the fused Pallas kernels
    of jaxtrain.kernels (evaluation stays jnp); ``conv``: whose convolutions (``jaxtrain.kernels.onednn.choose``:
    "auto" is oneDNN's on a CPU where it is usable, else XLA's). A language model (``gpt``) takes windows of
    ``input_shape[0]`` tokens over a vocabulary of ``num_classes``, its network of ``size`` (``gpt.SIZES``), its
    attention cuDNN's fused kernel in bf16 and fp16 where ``device`` (one of its devices: a ``jax.Device``) runs it
    (``gpt.fused_attention``), on a CPU in fp32 with its products oneDNN's where ``conv`` chooses oneDNN's kernels,
    else XLA's; its blocks laid out one after another (``unroll``, ``gpt.blocks``) or a
    loop over one (None: ``unrolled_where_faster``); its positions learned (GPT-2's) or ``rotary``."""
    from jaxtrain.choices import KERNELS
    from jaxtrain.errors import ConfigError, named

    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    inits = MODELS[name].inits
    init = init or inits[0]
    if init not in inits:
        raise ConfigError(f"model {name} has no init {init!r}: choose one of {', '.join(inits)}")
    shape = dict(input_shape=tuple(input_shape), num_classes=num_classes)
    if quantize != "none" and (quantize, name) != ("int8", "lenet"):
        after = ("post-training int8 with python -m experiments.quantize" if name in INT8_AFTER_TRAINING else
                 f"nor post-training int8, which covers {' and '.join(INT8_AFTER_TRAINING)}")
        raise ConfigError(f"{named('quantize', quantize)}: quantisation-aware training covers int8 for lenet only "
                          f"(model {name}: {after})")
    if kernels not in KERNELS:
        raise ConfigError(f"unknown kernels {kernels!r}: choose one of {', '.join(KERNELS)}")
    if name in LANGUAGE_MODELS:
        return _gpt(remat, shape, kernels, size or DEFAULT_SIZE, device, unroll, rotary, conv)
    if size is not None:
        raise ConfigError(f"size={size!r}: model {name} has one size (sizes are a language model's: "
                          f"{', '.join(LANGUAGE_MODELS)})")
    if rotary:
        raise ConfigError(f"{named('rotary', True)}: model {name} has no positions to turn (rotary positions are a "
                          f"language model's: {', '.join(LANGUAGE_MODELS)})")
    if unroll is not None:
        raise ConfigError(f"unroll={unroll!r}: model {name} has no blocks to unroll (a language model's: "
                          f"{', '.join(LANGUAGE_MODELS)})")
    try:
        conv_name, conv_fn = _conv(name, conv, quantize)
        return dataclasses.replace(BUILDERS[name](remat, init, shape, quantize, kernels, conv_fn), init_name=init,
                                   conv=conv_name)
    except ValueError as e:  # e.g. images too small for the model
        raise ConfigError(f"model {name}: {e}") from None


def _gpt_attention(device, conv: str) -> str:
    """The GPT's ``gpt.Config.attention`` on ``device``: "auto" where cuDNN's fused kernel runs (a GPU's), "onednn"
    on a CPU where ``conv`` chooses oneDNN's kernels (``onednn_attention.chosen``), else "xla"."""
    import jax

    from jaxtrain.kernels import onednn_attention
    from jaxtrain.models import gpt

    if not gpt.fused_attention(device):
        return "auto"
    platform = device.platform if device is not None else jax.default_backend()
    return "onednn" if platform == "cpu" and onednn_attention.chosen(conv) else "xla"


def _conv(name: str, conv: str, quantize: str) -> tuple[str, Callable]:
    """(name, fn) of the convolutions the model's layers run (``onednn.choose``). The ViT has none, and
    quantisation-aware layers bring their own (int8-rounding) ones: XLA's, never a oneDNN build or its warning."""
    from jaxtrain.choices import CONVS
    from jaxtrain.kernels import onednn

    own = name in VIT_CONFIGS or quantize != "none"
    return onednn.choose("xla" if own and conv in CONVS else conv)  # an unknown conv: choose's one-line error


def _lenet(remat: str, init: str, shape: dict, quantize: str, kernels: str, conv: Callable) -> Model:
    from jaxtrain.models import classify, lenet

    lenet.shapes(**shape)  # images too small: an error now
    ops = (conv, lenet.FLOAT_OPS[1])
    if quantize == "int8":
        from jaxtrain.nn.int8 import QAT_OPS as ops
    return Student(name="lenet", init=lambda rng: (lenet.init_params(rng, **shape), {}),
                   loss_fn=lenet.make_loss_fn(remat, classify.loss_head(kernels), ops), eval_fn=lenet.make_eval_fn(ops),
                   logits=lambda params, _, images: lenet.apply(params, images, ops=ops),
                   logical_axes=lenet.LOGICAL_AXES, head_loss=lambda head: lenet.make_loss_fn(remat, head, ops),
                   classifier="dense2/", **shape)


def _vit(remat: str, init: str, shape: dict, quantize: str, kernels: str, conv: Callable, name: str = "vit") -> Model:
    from jaxtrain.core.remat import remat as remat_block
    from jaxtrain.models import classify, vit
    from jaxtrain.models.sequential import sequential_loss

    fns = vit.bound(getattr(vit, VIT_CONFIGS[name]))
    layer = functools.partial(fns["block"], kernels=kernels)  # kernels="pallas": its layer norms too
    block = remat_block(layer, remat)
    fns["tokens"](shape["input_shape"])  # sides not divisible by the patch: an error now

    def head_loss(head):
        return sequential_loss(fns["embed_fn"], block, fns["head_loss"](head, kernels))

    return Stacked(name=name, init=lambda rng: (fns["init"](rng, **shape), {}),
                   loss_fn=head_loss(classify.loss_head(kernels)), eval_fn=fns["eval_fn"],
                   logits=lambda params, _, images: fns["apply"](params, images), head_loss=head_loss,
                   stack=Stack(fns["embed_fn"], layer, fns["head_loss"](classify.loss_head(kernels), kernels),
                               fns["head_eval_fn"]), classifier="head/(w|b)$", **shape)


VIT_CONFIGS = {"vit": "SMALL", "vit_tiny": "TINY16", "vit_small": "SMALL16", "vit_base": "BASE16"}  # vit.<config>


def _resnet18(remat: str, init: str, shape: dict, quantize: str, kernels: str, conv: Callable,
              stem: str = "d2l") -> Model:
    from jaxtrain.models import classify, resnet

    net = resnet.adapter(shape["input_shape"], shape["num_classes"], weight_init=init, remat=remat,
                         head=classify.loss_head(kernels), conv=conv, stem=stem)
    return Student(name="resnet18" if stem == "d2l" else "resnet18_imagenet",
                   init=lambda rng: resnet.init_variables(rng, weight_init=init, stem=stem, **shape),
                   loss_fn=net.loss_fn, eval_fn=net.eval_fn,
                   logits=lambda params, stats, images: net.module(params, stats)(images),
                   logical_axes=resnet.LOGICAL_AXES,
                   head_loss=lambda head: resnet.adapter(weight_init=init, remat=remat, head=head, conv=conv,
                                                         stem=stem, **shape).loss_fn,
                   classifier="dense/", **shape)


def _resnet50(remat: str, init: str, shape: dict, quantize: str, kernels: str, conv: Callable) -> Model:
    from jaxtrain.models import classify, resnet50

    net = resnet50.adapter(shape["input_shape"], shape["num_classes"], remat=remat, head=classify.loss_head(kernels),
                           conv=conv)
    return Student(name="resnet50", init=lambda rng: resnet50.init_variables(rng, **shape),
                   loss_fn=net.loss_fn, eval_fn=net.eval_fn,
                   logits=lambda params, stats, images: net.module(params, stats)(images),
                   logical_axes=resnet50.LOGICAL_AXES,
                   head_loss=lambda head: resnet50.adapter(remat=remat, head=head, conv=conv, **shape).loss_fn,
                   classifier="dense/", **shape)


def unrolled_where_faster(device=None, devices: int | None = None) -> bool:
    """Whether the GPT's blocks are laid out one after another on ``device`` (None: the default backend's first),
    one of ``devices`` in all processes (None: every device of its backend): where XLA ran the step faster so, a
    run of one CPU device in all (the mini GPT's step beside PyTorch's: torch/jaxtrain 0.800 unrolled, 0.584 as a
    loop). Over two virtual devices the loop is faster (0.686
    against 0.530 unrolled; docs/language-models.md), and two processes of one device each compile what one
    process of two does (their results equal bit for bit). GPUs keep the loop: unmeasured there, and it compiles
    one block, not L."""
    import jax

    device = device or jax.devices()[0]
    if device.platform != "cpu":  # (a compile-only GPU target's backend is not this process's: not counted)
        return False
    return (jax.device_count("cpu") if devices is None else devices) == 1  # every process's: one program


def _gpt(remat: str, shape: dict, kernels: str, size: str, device, unroll: bool | None, rotary: bool,
         conv: str = "auto") -> LanguageModel:
    """The GPT of ``size`` for windows of ``input_shape[0]`` tokens and a vocabulary of ``num_classes``."""
    from jaxtrain.errors import ConfigError, named
    from jaxtrain.models import gpt

    if size not in gpt.SIZES:
        raise ConfigError(f"model gpt has no size {size!r}: choose one of {', '.join(gpt.SIZES)}")
    if kernels != "jnp" or len(shape["input_shape"]) != 1:
        raise ConfigError("model gpt: " + (f"its loss is jnp's ({named('kernels', 'pallas')} is the image models')"
                                            if kernels != "jnp" else
                                            f"it takes windows of tokens ({named('dataset', 'text:PATH')})"))
    config = dataclasses.replace(gpt.SIZES[size], seq_len=shape["input_shape"][0], vocab=shape["num_classes"],
                                 attention=_gpt_attention(device, conv),
                                 unroll=unrolled_where_faster(device) if unroll is None else unroll,
                                 rotary=rotary)
    return LanguageModel(name="gpt", init=lambda rng: (gpt.init(rng, config), {}),
                         loss_fn=gpt.make_loss_fn(config, remat), eval_fn=gpt.make_eval_fn(config),
                         logits=lambda params, _, tokens: gpt.apply(params, tokens, config),
                         logical_axes=gpt.LOGICAL_AXES, init_name="gpt2", conv="xla", config=config,
                         stack=gpt.make_stack(config), **shape)


# name -> its builder (remat, init, shape, quantize, kernels, conv) -> Model
BUILDERS = {"lenet": _lenet, "resnet18": _resnet18, "resnet18_imagenet": functools.partial(_resnet18, stem="imagenet"),
            "resnet50": _resnet50, **{name: functools.partial(_vit, name=name) for name in VIT_CONFIGS}}
assert BUILDERS.keys() | set(LANGUAGE_MODELS) == MODELS.keys()


def revision_settings(name: str) -> dict:
    """What a run records of its model's revision (nothing for a first revision: older runs match)."""
    r = MODELS[name].revision
    return {"model_revision": r} if r > 1 else {}


def check_revision(name: str, settings: dict, what: str) -> None:
    """A ConfigError when ``what`` (a run, a checkpoint) was made by another revision of model ``name``."""
    from jaxtrain.errors import ConfigError

    theirs, ours = settings.get("model_revision", 1), MODELS[name].revision
    if theirs != ours:
        raise ConfigError(f"{what} holds {name} revision {theirs}; jaxtrain's {name} is now revision {ours} "
                          f"({MODELS[name].revised}): train it anew")
