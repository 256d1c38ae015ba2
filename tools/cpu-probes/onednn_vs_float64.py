"""oneDNN's and XLA's f32 gradients of one convolution against a float64 reference (XLA's conv in float64):
relative max error of dx and dw, batch 8 (docs/performance.md, "oneDNN convolutions", "Numbers").
    python tools/cpu-probes/onednn_vs_float64.py
"""

import jax
import jax.numpy as jnp
from jax import lax

jax.config.update("jax_enable_x64", True)
from jaxtrain.kernels import onednn  # noqa: E402

NHWC = ("NHWC", "HWIO", "NHWC")
SAME = ((1, 1), (1, 1))
CASES = {"3x3, 28x28x64": ((8, 28, 28, 64), (3, 3, 64, 64)), "3x3, 14x14x128": ((8, 14, 14, 128), (3, 3, 128, 128)),
         "stem, 28x28x1": ((8, 28, 28, 1), (3, 3, 1, 64))}


def grads(conv, x, w):
    def loss(x, w):
        return jnp.sin(conv(x, w, (1, 1), SAME, dimension_numbers=NHWC)).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


for name, (xs, ws) in CASES.items():
    x = jax.random.normal(jax.random.key(0), xs, jnp.float64)
    w = 0.05 * jax.random.normal(jax.random.key(1), ws, jnp.float64)
    ref = grads(lax.conv_general_dilated, x, w)
    for who, conv in (("xla", lax.conv_general_dilated), ("onednn", onednn.conv_general_dilated)):
        got = grads(conv, x.astype(jnp.float32), w.astype(jnp.float32))
        dx, dw = (float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, ref))
        print(f"{name:16s} {who:7s} dx {dx:.1e}  dw {dw:.1e}")
