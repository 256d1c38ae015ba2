"""A split held on the devices, and its batches gathered there: the host ``Loader``'s batches, bit for bit.

An in-memory ``Split`` is placed once (``place``: uint8 images, int32 labels, as the sharding it is handed
says); then each call of a many-step train function takes only a small int32 array of example indices
[K, B] (``train_indices``: the loader's own ``epoch_order``) and gathers its K batches on the device
(``train_batch``), crop+flip drawn there from the same (seed, epoch, index) bits as ``augment.random_bits``.
The evaluation batches need no host array at all (``eval_batch``: in order, padded and masked as the
loader pads them). Every function here is pure jnp: jittable, and usable one batch at a time inside a
``lax.scan`` body.

JAX runs with x64 off, so splitmix64 is computed on pairs of uint32 words (high, low): the same 64 bits.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.data import augment as augment_lib
from jaxtrain.data.loader import Loader, epoch_order
from jaxtrain.data.split import Split
from jaxtrain.errors import ConfigError, named

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceSplit:
    """A split on the devices: uint8 images [N, H, W, C] and int32 labels [N] (global jax Arrays).

    Pass it to a jitted function as an argument, never close over it: a closed-over array becomes a
    constant of the compiled program (the whole dataset copied into it)."""

    images: jax.Array
    labels: jax.Array

    def __len__(self) -> int:
        return self.labels.shape[0]


def put(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` (the same on every process) as a global array placed by ``sharding``: each process copies only
    the pieces its own devices hold (replicated: the whole of it; sharded: its devices' slices)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place(split: Split, sharding: jax.sharding.Sharding) -> DeviceSplit:
    """``split`` on the devices, once: images as uint8 (4x smaller than float32 batches), labels as int32.

    ``sharding``: the plan's choice, for the leading (examples) axis of both arrays. Replicated (e.g.
    ``plan.replicated``) every device holds the whole split (Fashion-MNIST's 60,000 training images: 47 MB
    per device; CIFAR-10's 50,000: 154 MB) and a batch is gathered without communication; sharded over
    "data", each device holds N / devices examples and XLA moves the rows a batch needs between devices.
    """
    if split.raw:
        raise ConfigError("a folder of image files cannot be placed on the devices: its images are decoded by the "
                          "host loader's workers; use a dataset held in memory (fashion_mnist, mnist, cifar10)")
    try:
        sharding.shard_shape(split.images.shape)
    except ValueError:  # sharded over more devices than divide N
        raise ConfigError(f"the {len(split)} examples do not split evenly over the devices of {sharding}: place the "
                          "split replicated, or use a number of examples the data shards divide") from None
    images = put(np.asarray(split.images, np.uint8), sharding)
    labels = put(np.asarray(split.labels, np.int32), sharding)
    log.debug("%d examples %s placed on %d devices (%.1f MB of images on each)", len(split), split.image_shape,
             len(sharding.device_set), images.addressable_shards[0].data.nbytes / 1e6)
    return DeviceSplit(images, labels)


def train_indices(loader: Loader, epoch: int, start: int, count: int) -> np.ndarray:
    """The example indices of training batches ``start .. start + count - 1`` of ``epoch``, int32 [count, B]:
    rows of the loader's own ``epoch_order`` (B: its global batch size), all that a call copies to the devices.
    Row b's slice of process p is what ``loader`` with that process's index builds for batch b."""
    if not loader.train:
        raise ConfigError(f"train_indices is for a training loader ({named('train', True)}); evaluation batches are "
                          "in order: eval_batch needs no indices")
    if start < 0 or count < 1 or start + count > len(loader):
        raise ConfigError(f"batches {start}..{start + count - 1} asked for, but an epoch has {len(loader)} "
                          f"(0..{len(loader) - 1})")
    size = loader.batch_size
    order = epoch_order(len(loader.split), loader.seed, epoch)
    return order[start * size:(start + count) * size].reshape(count, size).astype(np.int32)


def train_batch(data: DeviceSplit, index: jax.Array, seed: int, epoch, augment: str = "none") -> dict:
    """The training batches of the examples ``index`` (int32 [..., B]: one batch [B] inside a scan body, or
    K of them [K, B]), gathered on the device: ``{"image": float32 [..., B, H, W, C] in [0, 1], "label":
    int32 [..., B]}``, ``augment`` ("none" or "crop+flip") drawn from (``seed``, ``epoch``, index) as the
    host loader draws it. ``seed``: a Python int; ``epoch``: an int or a traced int32 scalar."""
    if augment_lib.get(augment) is None:  # "rrc+flip" or an unknown name: the loader's ConfigError
        images = data.images[index]
    else:
        images = crop_flip(data.images[index], seed, epoch, index)
    return {"image": normalise(images), "label": data.labels[index]}


def eval_batch(data: DeviceSplit, b, batch_size: int) -> dict:
    """Evaluation batch ``b`` (an int or a traced int32; an array [K] of them gives K batches) of
    ``batch_size`` examples, in order, as the loader builds it: past the split's end, padded with example 0
    and ``mask`` False. All ``-(-len(data) // batch_size)`` batches: ``b = jnp.arange(count)``, one call."""
    index = jnp.asarray(b, jnp.int32)[..., None] * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
    real = index < len(data)
    index = jnp.where(real, index, 0)
    return {"image": normalise(data.images[index]), "label": data.labels[index], "mask": real}


def normalise(images: jax.Array) -> jax.Array:
    """uint8 pixels -> float32 in [0, 1]: the very product ``loader.normalise`` computes, so the same bits."""
    return images.astype(jnp.float32) * np.float32(1 / 255)


# splitmix64 on (high, low) uint32 pairs: jax's x64 is off, and uint32 arithmetic wraps as uint64's does.
_U32 = np.uint32


def _pair(x) -> tuple[jax.Array, jax.Array]:
    """A 64-bit value as (high, low) uint32 words: a Python int taken modulo 2**64 (as ``augment`` takes the
    seed); a numpy integer (array) split on the host; a jax integer array (non-negative) as its low word; a
    (high, low) pair as it is."""
    if isinstance(x, tuple):
        return jnp.asarray(x[0], _U32), jnp.asarray(x[1], _U32)
    if isinstance(x, int):
        x = np.uint64(x % 2**64)
    if isinstance(x, (np.ndarray, np.integer)):  # on the host, where 64-bit integers exist
        x = np.asarray(x).astype(np.uint64)
        return jnp.asarray((x >> np.uint64(32)).astype(_U32)), jnp.asarray((x & np.uint64(0xFFFFFFFF)).astype(_U32))
    low = jnp.asarray(x).astype(_U32)
    return jnp.zeros_like(low), low


def _const(value: int) -> tuple[np.uint32, np.uint32]:
    return _U32(value >> 32), _U32(value & 0xFFFFFFFF)


def _add(a, b):
    low = a[1] + b[1]
    return a[0] + b[0] + (low < a[1]).astype(_U32), low


def _xor(a, b):
    return a[0] ^ b[0], a[1] ^ b[1]


def _shift_right(a, s: int):
    """a >> s for 0 < s < 32."""
    return a[0] >> s, (a[1] >> s) | (a[0] << (32 - s))


def _mul_wide(a, b):
    """The full 64-bit product of two uint32 words, from 16-bit halves (each partial product fits in 32 bits)."""
    a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)  # < 3 * 2**16
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), (mid << 16) | (p00 & 0xFFFF)


def _mul(a, b):
    """a * b modulo 2**64."""
    high, low = _mul_wide(a[1], b[1])
    return high + a[1] * b[0] + a[0] * b[1], low


_M1, _M2, _GAMMA = (_const(int(c)) for c in (augment_lib.M1, augment_lib.M2, augment_lib.GAMMA))


def _mix(x):
    """splitmix64's finaliser (``augment._mix``) on a (high, low) pair."""
    x = _add(x, _GAMMA)
    x = _mul(_xor(x, _shift_right(x, 30)), _M1)
    x = _mul(_xor(x, _shift_right(x, 27)), _M2)
    return _xor(x, _shift_right(x, 31))


def random_bits(seed, epoch, index) -> tuple[jax.Array, jax.Array]:
    """``augment.random_bits`` on the device: the same 64 bits per example, as (high, low) uint32 arrays.

    ``seed``, ``epoch``: Python ints (any size, taken modulo 2**64) or non-negative integer scalars;
    ``index``: non-negative integers, or a (high, low) uint32 pair for indices past 2**32."""
    key = _mix(_xor(_mix(_pair(seed)), _pair(epoch)))
    return _mix(_xor(key, _pair(index)))


def _mod(a, m: int) -> jax.Array:
    """a modulo a small m (m * m < 2**32), as uint32: 2**32 * high + low, reduced word by word."""
    return ((a[0] % m) * _U32(2**32 % m) + a[1] % m) % m


def crop_flip(images: jax.Array, seed, epoch, index, pad: int = augment_lib.PAD) -> jax.Array:
    """``augment.crop_flip`` on the device, bit for bit: images [..., H, W, C] of the examples ``index`` [...]
    zero-padded by ``pad``, cropped back to H x W at an offset drawn from their bits, mirrored on one bit."""
    *lead, h, w, c = images.shape
    bits = random_bits(seed, epoch, index)
    dy = _mod(bits, 2 * pad + 1).astype(jnp.int32).reshape(-1)
    dx = _mod(_shift_right(bits, 16), 2 * pad + 1).astype(jnp.int32).reshape(-1)
    flip = (bits[0] & 1).astype(bool).reshape(-1)  # bit 32
    padded = jnp.pad(images.reshape(-1, h, w, c), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    rows = dy[:, None] + jnp.arange(h)
    cols = dx[:, None] + jnp.where(flip[:, None], jnp.arange(w)[::-1], jnp.arange(w))
    n = padded.shape[0]
    return padded[jnp.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]].reshape(*lead, h, w, c)
