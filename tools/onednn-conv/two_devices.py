"""One convolution's gradient with the batch split over 2 virtual CPU devices, XLA's vs oneDNN's (dconv): does the
compiled program gather the batch, how many all-reduces, the gradient's sharding and the sum of dw (equal when
right).   python tools/onednn-conv/two_devices.py"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxtrain as jt

devices = jt.setup_devices(2)
import jax
import jax.numpy as jnp
from dconv import conv_general_dilated
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

mesh = jt.make_mesh(devices)
x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 14, 14, 16)), NamedSharding(mesh, P("data")))
w = jax.device_put(jax.random.normal(jax.random.key(1), (3, 3, 16, 32)) * 0.1, NamedSharding(mesh, P()))


def loss(x, w, conv):
    return jnp.sum(jnp.cos(conv(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))))


for name, conv in (("XLA", lax.conv_general_dilated), ("oneDNN", conv_general_dilated)):
    grad = jax.jit(jax.grad(lambda x, w, conv=conv: loss(x, w, conv), argnums=(0, 1)))
    text = grad.lower(x, w).compile().as_text()
    gx, gw = grad(x, w)
    print(
        f"{name}: all-gather {'all-gather' in text}, all-reduces {text.count('all-reduce(')}, "
        f"dx sharding {gx.sharding.spec}, sum(dw) {float(jnp.sum(gw)):.4f}"
    )

# The same gradient inside shard_map (each device convolves its own share; dw summed over "data" by the VJP),
# as jaxtrain's shard_map strategy runs a model.
for name, conv in (("XLA", lax.conv_general_dilated), ("oneDNN", conv_general_dilated)):

    def per_device(x, w, conv=conv):
        return jax.grad(lambda x, w: loss(x, w, conv), argnums=(0, 1))(x, w)

    gx, gw = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P())))(x, w)
    print(f"{name} under shard_map: sum(dx) {float(jnp.sum(gx)):.4f}, sum(dw) {float(jnp.sum(gw)):.4f}")
