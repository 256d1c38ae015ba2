"""8 activation relayouts and 8 kernel flips ([3,3,512,512]: reverse + swap) vs plain copies; run it with and
without XLA_FLAGS=--xla_cpu_experimental_enable_tiling_propagation=true.   python tools/cpu-probes/transposes.py
"""

import os
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type=reduce"
import jax
import jax.numpy as jnp
import numpy as np


def timeit(f, *a, n=30):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return 1000 * float(np.median(ts))


k = jax.random.key(0)
# many distinct arrays so they are not cache-resident: cycle through 8
xs = [jax.random.normal(jax.random.key(i), (64, 28, 28, 64)) for i in range(8)]
ws = [jax.random.normal(jax.random.key(i), (3, 3, 512, 512)) for i in range(8)]
t1 = jax.jit(lambda xs: [jnp.transpose(x, (3, 1, 2, 0)) for x in xs])
t2 = jax.jit(lambda ws: [jnp.transpose(w[::-1, ::-1], (0, 1, 3, 2)) for w in ws])
t3 = jax.jit(lambda ws: [jnp.transpose(w, (0, 1, 3, 2)) for w in ws])
cp = jax.jit(lambda xs: [x * 2 for x in xs])
print("act relayout x8", timeit(t1, xs), "copy x8", timeit(cp, xs))
print("kernel flip x8", timeit(t2, ws), "swap only x8", timeit(t3, ws), "copy x8", timeit(cp, ws))
