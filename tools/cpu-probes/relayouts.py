"""The weight-gradient relayout [B,H,W,C] -> [C,H,W,B] of 8 arrays: XLA's one transpose vs an identity GEMM plus
a row permutation vs two passes of 16x16 tiles kept apart by jaxtrain.core.remat.materialize (all checked equal).
    python tools/cpu-probes/relayouts.py 64,28,28,64
"""

import sys

import jaxtrain as jt

jt.setup_devices(1)  # jaxtrain's CPU flags (as training gets them), one device with every core
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtrain.core.remat import materialize
from jaxtrain.train.timing import median_seconds


def timeit(f, *a, n=30):
    """Median ms of ``f(*a)`` (jaxtrain.train.timing, after a warm-up)."""
    return 1000 * median_seconds(lambda: jax.block_until_ready(f(*a)), n)


shape = tuple(int(v) for v in sys.argv[1].split(","))
B, H, W, C = shape
xs = [jax.random.normal(jax.random.key(i), shape) for i in range(8)]


def direct(x):
    return jnp.transpose(x, (3, 1, 2, 0))


def batched(x):  # [HW, C, B] via batched identity matmul, then [C, HW, B]
    xr = x.reshape(B, H * W, C)
    y = lax.dot_general(xr, jnp.eye(B, dtype=x.dtype), (((0,), (0,)), ((), ())))  # [HW, C, B]
    return jnp.transpose(materialize(y), (1, 0, 2)).reshape(C, H, W, B)


def blocked(x):  # two passes, 16x16 tiles
    b2 = c2 = 16
    t = x.reshape(B // b2, b2, H, W, C // c2, c2).transpose(0, 2, 3, 4, 1, 5)  # [B1,H,W,C1,b2,c2]
    t = materialize(t)
    return t.transpose(3, 5, 1, 2, 0, 4).reshape(C, H, W, B)


ref = direct(xs[0])
for f in (direct, batched, blocked):
    g = jax.jit(lambda xs, f=f: [f(x) for x in xs])
    assert np.array_equal(np.asarray(g(xs)[0]), np.asarray(ref)), f.__name__
    print(f.__name__, round(timeit(g, xs), 1), "ms x8")
