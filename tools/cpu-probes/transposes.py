"""8 activation relayouts and 8 kernel flips ([3,3,512,512]: reverse + swap) vs plain copies; run it with and
without XLA_FLAGS=--xla_cpu_experimental_enable_tiling_propagation=true.   python tools/cpu-probes/transposes.py
"""

import jaxtrain as jt

jt.setup_devices(1)  # jaxtrain's CPU flags (as training gets them), one device with every core
import jax
import jax.numpy as jnp

from jaxtrain.train.timing import median_seconds


def timeit(f, *a, n=30):
    """Median ms of ``f(*a)`` (jaxtrain.train.timing, after a warm-up)."""
    return 1000 * median_seconds(lambda: jax.block_until_ready(f(*a)), n)


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
