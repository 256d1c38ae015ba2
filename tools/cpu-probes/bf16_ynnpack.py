"""A hand-written SGD step in fp32 and bf16, each compiled with Eigen's convolutions (jaxtrain's CPU flag) and
with YNNPACK's for convolutions and dots (per-jit compiler options), interleaved rounds.
    python tools/cpu-probes/bf16_ynnpack.py lenet|resnet18 DEVICES ROUNDS
"""

import statistics
import sys
import time

import jaxtrain as jt

devs = jt.setup_devices(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import models
from jaxtrain.core.precision import cast_floats

name = sys.argv[1]
model = models.get(name)
B = 256 if name == "lenet" else 64
mesh = jt.make_mesh(devs)
p0, s0 = jax.jit(model.init)(jax.random.key(0))
rep, sh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
batch = jax.device_put(model.example_batch(B), sh)


def step(carry, b, dt):
    params, ms = carry

    def loss(p):
        v, aux = model.loss_fn(cast_floats(p, dt), ms, cast_floats(b, dt), None)
        return v.astype(jnp.float32), aux

    (v, (ms, _)), g = jax.value_and_grad(loss, has_aux=True)(params)
    return (jax.tree.map(lambda p, g: p - 0.2 * g, params, g), ms), v


YNN = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                                            "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION,"
                                            "LIBRARY_FUSION_TYPE_REDUCE"
}
variants = {}
for dt, dn in ((jnp.float32, "fp32"), (jnp.bfloat16, "bf16")):
    for opt, on in ((None, "eigen"), (YNN, "ynn")):
        f = jax.jit(lambda c, b, dt=dt: step(c, b, dt), in_shardings=(rep, sh), out_shardings=rep, compiler_options=opt)
        variants[f"{dn}-{on}"] = [f, jax.device_put((p0, s0), rep)]
n = 10 if name == "lenet" else 2


def block(k):
    f, c = variants[k]
    for _ in range(2):
        c, v = f(c, batch)
    v.block_until_ready()
    t = time.perf_counter()
    for _ in range(n):
        c, v = f(c, batch)
    v.block_until_ready()
    variants[k][1] = c
    return (time.perf_counter() - t) / n * 1000


for k in variants:
    block(k)
times = {k: [] for k in variants}
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 8):
    ks = list(variants)
    ks = ks[r % 4 :] + ks[: r % 4]
    for k in ks:
        time.sleep(0.3)
        times[k].append(block(k))
for k, v in times.items():
    print(k, round(statistics.median(v), 1), "ms")
