"""A multi-process run's preflight: one all-reduce over every device and one matmul per device, timed, before the
first step, in one line that names a slow process by rank and host.

A process that never joins is caught earlier (``processes``: the join's own timeout); this catches the one that
joined but is slow (a throttled GPU, a busy host, a slow link), before hours of steps wait on it.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from jaxtrain.parallel import hosts

MATMUL = 512  # the matmul's side: ~0.27 GFLOP, milliseconds on a CPU core, microseconds on a GPU
SLOW = 2.0  # a process this many times the median matmul time (and at least GAP seconds more) is named slow
GAP = 1e-3  # GPUs do the matmul in microseconds, where a dispatch's jitter alone is 2x
REPEATS = 3  # each timing: the fastest of this many calls


def _timed(fn, *args) -> float:
    """Seconds of the fastest of REPEATS calls of ``fn`` after a first (compiling) one."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def run(devices) -> str:
    """Time the all-reduce and the matmuls (every process calls it), gather the times, and return process 0's
    line (the others get "")."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("all",))
    ones = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")),
                                                  np.ones(jax.local_device_count(), np.float32))
    reduce_s = _timed(jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P())), ones)
    square = jax.jit(lambda a: a @ a)
    matmul_s = max(_timed(square, jax.device_put(np.ones((MATMUL, MATMUL), np.float32), d))
                   for d in devices if d.process_index == jax.process_index())
    times = np.asarray(multihost_utils.process_allgather(np.array([reduce_s, matmul_s])))
    return describe(times[:, 0], times[:, 1], [hosts.host_of(p) for p in range(len(times))])


def describe(reduce_s, matmul_s, names: list[str]) -> str:
    """The preflight's line from every process's all-reduce and (slowest device's) matmul seconds."""
    import jax

    if jax.process_index() != 0:
        return ""
    median = statistics.median(matmul_s)
    slow = [p for p, t in enumerate(matmul_s) if t > SLOW * median and t - median > GAP]
    line = (f"preflight: {len(names)} processes on {len(set(names))} host(s): all-reduce {1e3 * max(reduce_s):.1f} "
            f"ms, matmul {MATMUL}x{MATMUL} {1e3 * min(matmul_s):.1f}-{1e3 * max(matmul_s):.1f} ms per device")
    if slow:
        line += "; slow: " + ", ".join(f"process {p} on {names[p]} ({1e3 * matmul_s[p]:.1f} ms, "
                                       f"{matmul_s[p] / median:.1f}x the median)" for p in slow)
    return line
