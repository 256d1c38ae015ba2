"""Each ResNet-18 convolution shape alone (batch 64, one device): XLA's convolution vs im2col + one dot,
forward and forward+backward ms.   python tools/cpu-probes/im2col_vs_conv.py [BATCH]
(The stride-2 rows' im2col pads symmetrically, unlike SAME: their err column is not 0; timing only.)
"""

import sys

import jaxtrain as jt

jt.setup_devices(1)  # jaxtrain's CPU flags (as training gets them), one device with every core
import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.train.timing import median_seconds


def conv_xla(x, w, s):
    return lax.conv_general_dilated(
        x, w, (s, s), "SAME" if w.shape[0] > 1 else "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def conv_im2col(x, w, s):
    kh, kw, ci, co = w.shape
    B, H, W, C = x.shape
    if kh == 1:
        xs = x[:, ::s, ::s, :]
        return jnp.dot(xs.reshape(-1, ci), w.reshape(ci, co)).reshape(xs.shape[:3] + (co,))
    p = kh // 2
    xp = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    Ho, Wo = (H + s - 1) // s, (W + s - 1) // s
    cols = [
        lax.slice(xp, (0, i, j, 0), (B, i + (Ho - 1) * s + 1, j + (Wo - 1) * s + 1, C), (1, s, s, 1))
        for i in range(kh)
        for j in range(kw)
    ]
    patches = jnp.concatenate(cols, axis=-1)
    return jnp.dot(patches.reshape(-1, kh * kw * ci), w.reshape(-1, co)).reshape(B, Ho, Wo, co)


def timeit(f, *a, n=20):
    """Median ms of ``f(*a)`` (jaxtrain.train.timing, after a warm-up)."""
    return 1000 * median_seconds(lambda: jax.block_until_ready(f(*a)), n)


B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
shapes = [
    (28, 64, 64, 3, 1),
    (28, 64, 128, 3, 2),
    (28, 64, 128, 1, 2),
    (14, 128, 128, 3, 1),
    (14, 128, 256, 3, 2),
    (7, 256, 256, 3, 1),
    (7, 256, 512, 3, 2),
    (4, 512, 512, 3, 1),
]
k = jax.random.key(0)
print("H ci co k s | fwd xla im2col | vjp xla im2col")
for H, ci, co, kk, s in shapes:
    x = jax.random.normal(k, (B, H, H, ci))
    w = jax.random.normal(k, (kk, kk, ci, co)) * 0.05
    r = []
    for f in (conv_xla, conv_im2col):
        fwd = jax.jit(lambda x, w, f=f: f(x, w, s))
        y = fwd(x, w)
        dy = jnp.ones_like(y)
        bwd = jax.jit(lambda x, w, dy, f=f: jax.vjp(lambda x, w: f(x, w, s), x, w)[1](dy))
        r.append((timeit(fwd, x, w), timeit(bwd, x, w, dy)))
    a, b = conv_xla(x, w, s), conv_im2col(x, w, s)
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    print(
        f"{H} {ci} {co} {kk} {s} | {r[0][0]:.2f} {r[1][0]:.2f} | {r[0][1]:.2f} {r[1][1]:.2f} | err {err:.1e}",
        flush=True,
    )
