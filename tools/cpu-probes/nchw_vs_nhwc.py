"""Two stacked 3x3 convolutions with a ReLU, forward and both gradients, per ResNet-18 stage (batch 64): NHWC vs
NCHW dimension numbers; ms and the transposes in the compiled program.   python tools/cpu-probes/nchw_vs_nhwc.py
"""

import jaxtrain as jt

jt.setup_devices(1)  # jaxtrain's CPU flags (as training gets them), one device with every core
import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.train.timing import median_seconds


def timeit(f, *a, n=20):
    """Median ms of ``f(*a)`` (jaxtrain.train.timing, after a warm-up)."""
    return 1000 * median_seconds(lambda: jax.block_until_ready(f(*a)), n)


B = 64
for H, C in ((28, 64), (14, 128), (7, 256), (4, 512)):
    r = {}
    for dn in ("NHWC", "NCHW"):
        xs = (B, H, H, C) if dn == "NHWC" else (B, C, H, H)
        x = jax.random.normal(jax.random.key(0), xs)
        w = jax.random.normal(jax.random.key(1), (3, 3, C, C)) * 0.05

        # two convs in a row with a relu, fwd + grad wrt x and w: the middle activation stays in the model's layout
        def f(x, w):
            def c(a):
                return lax.conv_general_dilated(a, w, (1, 1), "SAME", dimension_numbers=(dn, "HWIO", dn))

            return jnp.sum(c(jax.nn.relu(c(x))) ** 2)

        g = jax.jit(jax.grad(f, argnums=(0, 1)))
        hlo = g.lower(x, w).compile().as_text()
        r[dn] = (timeit(g, x, w), hlo.count(" transpose(") + hlo.count("transpose_copy"))
    print(H, C, r, flush=True)
