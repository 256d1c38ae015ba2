"""The mini GPT's attention with its batched products on oneDNN (``onednn_attention.cc``: oneDNN's batched matmul
through the XLA FFI, over both cores) against XLA:CPU's (one core: docs/language-models.md, "Where the rest goes on
this CPU"), alone and in the GPT's step: a probe of what such a kernel would buy, not jaxtrain's code.

    .venv/bin/python tools/cpu-probes/onednn_attention.py [REPEATS]

Compiles the kernel with g++ against the venv's oneDNN 3 (jaxtrain's cpu-conv extra) into a temporary folder. One
device, fp32. The attention: queries, keys and values [B, T, H, C] laid out [B*H, T, C], the scores and the
probabilities x values as oneDNN calls (their gradients too: a custom VJP of four more calls), the mask and softmax
XLA's. Prints the largest differences from ``jax.nn.dot_product_attention`` (outputs and gradients), the attention's
forward and forward + backward (batch 32, 128 tokens, 4 heads of 64; median ms, the two alternating), and the mini
GPT's hand-written SGD step with each (batch 32, ``REPEATS`` x 3 steps, interleaved, paired).
"""

import contextlib
import ctypes
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jaxtrain as jt

jt.setup_devices(1)
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from jaxtrain import models

THREADS = len(os.sched_getaffinity(0))


def load() -> None:
    out = Path(tempfile.mkdtemp(prefix="jaxtrain-probe-")) / "onednn_attention.so"
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-fopenmp", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
                    f"-I{sys.prefix}/include", f"-L{sys.prefix}/lib", f"-Wl,-rpath,{sys.prefix}/lib",
                    str(Path(__file__).with_suffix(".cc")), "-ldnnl", "-o", str(out)], check=True)
    lib = ctypes.cdll.LoadLibrary(str(out))
    jax.ffi.register_ffi_target("ProbeDnnlBmm", jax.ffi.pycapsule(lib.ProbeDnnlBmm), platform="cpu")


def call(a, b, ta: int, tb: int):
    """op(a) @ op(b) per leading index: a [N, M, K] (ta: [N, K, M]), b [N, K, P] (tb: [N, P, K])."""
    m, p = a.shape[2 if ta else 1], b.shape[1 if tb else 2]
    out = jax.ShapeDtypeStruct((a.shape[0], m, p), a.dtype)
    return jax.ffi.ffi_call("ProbeDnnlBmm", out)(a, b, ta=ta, tb=tb, threads=THREADS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def bmm(a, b, ta: int, tb: int):
    return call(a, b, ta, tb)


def _bmm_fwd(a, b, ta, tb):
    return call(a, b, ta, tb), (a, b)


def _bmm_bwd(ta, tb, res, g):  # c = A B: dA = g B^T, dB = A^T g (each transposed back where a or b holds A^T, B^T)
    a, b = res
    da = call(b, g, tb, 1) if ta else call(g, b, 0, 1 - tb)
    db = call(g, a, 1, ta) if tb else call(a, g, 1 - ta, 0)
    return da, db


bmm.defvjp(_bmm_fwd, _bmm_bwd)


def attention(q, k, v, is_causal=True, **_):
    """Causal attention of q, k, v [B, T, H, C] -> [B, T, H, C] (fp32), its two products oneDNN's."""
    b, t, h, c = q.shape
    qh, kh, vh = (x.transpose(0, 2, 1, 3).reshape(b * h, t, c) for x in (q, k, v))
    s = bmm(qh, kh, 0, 1) * jnp.float32(c ** -0.5)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
    o = bmm(jax.nn.softmax(s, axis=-1), vh, 0, 0)
    return o.reshape(b, h, t, c).transpose(0, 2, 1, 3)


def xla_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def median_ms(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@contextlib.contextmanager
def onednn_attention_in_the_model():
    """``jax.nn.dot_product_attention`` is the probe's while a program is traced (the GPT's block calls it)."""
    kept = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = attention
    try:
        yield
    finally:
        jax.nn.dot_product_attention = kept


def main(argv) -> int:
    repeats = int(argv[0]) if argv else 8
    load()
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((32, 128, 4, 64)), jnp.float32) for _ in range(3))
    grads = {name: jax.jit(jax.grad(lambda *a, f=f: (f(*a) ** 2).sum(), argnums=(0, 1, 2)))
             for name, f in (("xla", xla_attention), ("onednn", attention))}
    out_diff = float(jnp.abs(jax.jit(attention)(q, k, v) - xla_attention(q, k, v)).max())
    g_xla, g_dnn = grads["xla"](q, k, v), grads["onednn"](q, k, v)
    g_diff = max(float(jnp.abs(x - y).max() / jnp.abs(x).max()) for x, y in zip(g_xla, g_dnn))
    print(f"largest difference from jax.nn.dot_product_attention: outputs {out_diff:.2g}, gradients {g_diff:.2g} "
          "of their largest")

    rows = {"forward": {n: jax.jit(f) for n, f in (("xla", xla_attention), ("onednn", attention))},
            "forward + backward": {n: jax.jit(jax.grad(lambda *a, f=f: f(*a).sum(), argnums=(0, 1, 2)))
                                   for n, f in (("xla", xla_attention), ("onednn", attention))}}
    print("\n| the attention's | XLA:CPU ms | oneDNN's products ms | XLA / oneDNN |\n|---|---|---|---|")
    for row, fns in rows.items():
        rounds = [{n: median_ms(lambda f=f: jax.block_until_ready(f(q, k, v)), 20) for n, f in fns.items()}
                  for _ in range(3)]  # the two alternating
        xla, dnn = (statistics.median(r[n] for r in rounds) for n in ("xla", "onednn"))
        print(f"| {row} | {xla:.2f} | {dnn:.2f} | {xla / dnn:.2f} |")

    model = models.get("gpt", input_shape=(128,), num_classes=4096, size="mini")
    params, model_state = jax.jit(model.init)(jax.random.key(0))
    batch = jax.device_put(model.example_batch(32))

    def compiled(carry):
        """The step compiled now (a new function each time: JAX keeps a function's traces)."""
        def sgd_step(carry, b):
            p, s = carry
            (value, (s, _)), g = jax.value_and_grad(lambda p: model.loss_fn(p, s, b, None), has_aux=True)(p)
            return (jax.tree.map(lambda p, g: p - 0.2 * g, p, g), s), {"loss": value}

        return jax.jit(sgd_step, donate_argnums=0).lower(carry, batch).compile()

    carry = (params, model_state)
    runs = {"xla": harness.Timed(compiled(carry), jax.tree.map(jnp.copy, carry), batch)}
    with onednn_attention_in_the_model():
        runs["onednn"] = harness.Timed(compiled(carry), jax.tree.map(jnp.copy, carry), batch)
    assert "ProbeDnnlBmm" in runs["onednn"].step.as_text() and "ProbeDnnlBmm" not in runs["xla"].step.as_text()
    for run in runs.values():
        harness.warm_up(run, 2)
    harness.interleave(runs.values(), 3, repeats)
    print(f"\nthe mini GPT's step (hand-written SGD, batch 32, one device): XLA's attention {runs['xla'].median:.1f} "
          f"ms, oneDNN's products {runs['onednn'].median:.1f} ms; paired oneDNN/XLA "
          f"{harness.paired(runs['onednn'], runs['xla']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
