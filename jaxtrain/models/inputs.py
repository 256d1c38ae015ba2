"""What the models' image input must look like, checked while the step is traced (shapes and dtypes are static:
the check costs nothing per step). Labels are checked where the loss takes them (``classify``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.errors import ConfigError


def checked_images(images: jax.Array, channels: int, model: str, dtype=None) -> jax.Array:
    """``images`` if they are float ``[batch, height, width, channels]``; uint8 pixels (an image folder's batches)
    normalised here, on the device, to [0, 1] in fp32 as the host would, then cast to ``dtype`` (the first
    layer's: the precision policy's); else a ConfigError saying what ``model`` takes (``channels``: its first
    layer's)."""
    if jnp.ndim(images) != 4 or images.shape[-1] != channels:
        raise ConfigError(f"batch['image'] has examples of shape {tuple(images.shape[1:])}: {model} takes images "
                          f"[batch, height, width, channels] with {channels} channel(s), as its first layer's "
                          f"weights (e.g. add the channel axis: images[..., None])")
    if images.dtype == jnp.uint8:
        return (images.astype(jnp.float32) * jnp.float32(1 / 255)).astype(dtype or jnp.float32)
    if not jnp.issubdtype(images.dtype, jnp.floating):
        raise ConfigError(f"batch['image'] is {images.dtype}: {model} takes float images (e.g. images / 255.0, as "
                          "jaxtrain's loaders give them) or uint8 pixels")
    return images


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # torchvision's / timm's ResNets'


def imagenet_normalized(images: jax.Array) -> jax.Array:
    """``(images - mean) / std`` with ImageNet's per-channel statistics, as torchvision's transforms feed its
    ResNets (images in [0, 1]); an image of another channel count takes their averages in every channel."""
    c = images.shape[-1]
    mean = jnp.asarray(IMAGENET_MEAN if c == 3 else [sum(IMAGENET_MEAN) / 3] * c, images.dtype)
    std = jnp.asarray(IMAGENET_STD if c == 3 else [sum(IMAGENET_STD) / 3] * c, images.dtype)
    return (images - mean) / std
