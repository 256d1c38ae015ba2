"""LeNet conv2's input gradient (20 -> 50 channels, 5x5) as XLA computes it vs with its 20 output channels padded
to 24/32/48 (kernel zero-padded, result sliced).   python tools/cpu-probes/conv2_channel_padding.py BATCH
"""

import sys

import jaxtrain as jt

jt.setup_devices(1)  # jaxtrain's CPU flags (as training gets them), one device with every core
import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.train.timing import median_seconds


def timeit(f, *a, n=40):
    """Median ms of ``f(*a)`` (jaxtrain.train.timing, after a warm-up)."""
    return 1000 * median_seconds(lambda: jax.block_until_ready(f(*a)), n)


B = int(sys.argv[1])
dy = jax.random.normal(jax.random.key(0), (B, 9, 9, 50))
x = jax.random.normal(jax.random.key(2), (B, 13, 13, 20))
w = jax.random.normal(jax.random.key(1), (5, 5, 20, 50))


def conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))


ref = jax.jit(lambda x, w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0])
r = ref(x, w, dy)
res = {"xla vjp dx": timeit(ref, x, w, dy)}
for ci in (20, 24, 32, 48):

    def dx(w, dy, ci=ci):
        wt = jnp.transpose(w[::-1, ::-1], (0, 1, 3, 2))  # [5,5,50,20]
        wt = jnp.pad(wt, ((0, 0), (0, 0), (0, 0), (0, ci - 20)))
        out = lax.conv_general_dilated(dy, wt, (1, 1), ((4, 4), (4, 4)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return out[..., :20]

    f = jax.jit(dx)
    assert float(jnp.max(jnp.abs(f(w, dy) - r))) < 1e-3
    res[f"padded {ci}"] = timeit(f, w, dy)
print(B, {k: round(v, 2) for k, v in res.items()})
