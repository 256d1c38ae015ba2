"""Each of ResNet-18's convolution shapes alone (batch 64, one device): forward and forward+backward ms, XLA vs
oneDNN (dconv), and the relative differences of y, dx, dw.   python tools/onednn-conv/per_conv.py"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxtrain as jt

jt.setup_devices(1)  # jaxtrain's CPU flags (as training gets them), one device with every core
import jax
import jax.numpy as jnp
from dconv import conv_general_dilated as dcg
from jax import lax

from jaxtrain.timing import median_seconds


def timeit(f, *a, n=20):
    """Median ms of ``f(*a)`` (jaxtrain.timing, after a warm-up)."""
    return 1000 * median_seconds(lambda: jax.block_until_ready(f(*a)), n)


B = 64
shapes = [
    (28, 64, 64, 3, 1),
    (28, 64, 128, 3, 2),
    (28, 64, 128, 1, 2),
    (14, 128, 128, 3, 1),
    (7, 256, 256, 3, 1),
    (4, 512, 512, 3, 1),
]
for H, ci, co, k, s in shapes:
    x = jax.random.normal(jax.random.key(0), (B, H, H, ci))
    w = jax.random.normal(jax.random.key(1), (k, k, ci, co)) * 0.05
    pad = "SAME" if k > 1 else "VALID"
    res = {}
    outs = {}
    for name, cg in (("xla", lax.conv_general_dilated), ("dnnl", dcg)):
        f = lambda x, w, cg=cg: cg(x, w, (s, s), pad, dimension_numbers=("NHWC", "HWIO", "NHWC"))
        fwd = jax.jit(f)
        y = fwd(x, w)
        dy = jnp.cos(y)
        bwd = jax.jit(lambda x, w, dy, f=f: jax.vjp(f, x, w)[1](dy))
        outs[name] = (y, *bwd(x, w, dy))
        res[name] = (round(timeit(fwd, x, w), 2), round(timeit(bwd, x, w, dy), 2))
    errs = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))) for a, b in zip(outs["xla"], outs["dnnl"])]
    print(H, ci, co, k, s, res, "rel err", ["%.1e" % e for e in errs], flush=True)
