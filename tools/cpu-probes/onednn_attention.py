"""The mini GPT's attention with its batched products on oneDNN (``jaxtrain.kernels.onednn_attention``: oneDNN's
batched matmul through the XLA FFI, over the cores) against XLA:CPU's (one core: docs/language-models.md, "Where
the rest goes on this CPU"), alone and in the GPT's step.

    .venv/bin/python tools/cpu-probes/onednn_attention.py [REPEATS]

One device, fp32. Prints the largest differences from ``jax.nn.dot_product_attention`` (outputs and gradients),
the attention's forward and forward + backward (batch 32, 128 tokens, 4 heads of 64; median ms, the two
alternating), and the mini GPT's hand-written SGD step with each (``models.get("gpt", conv="xla")`` against the
default, a CPU's oneDNN products; batch 32, ``REPEATS`` x 3 steps, interleaved, paired).
"""

import statistics
import sys

import jaxtrain as jt

jt.setup_devices(1)
import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness
from gpt_dots import median_ms  # noqa: E402  (beside this script)
from jaxtrain import models
from jaxtrain.kernels.onednn_attention import attention


def xla_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def main(argv) -> int:
    repeats = int(argv[0]) if argv else 8
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

    runs = {}
    for name, conv in (("xla", "xla"), ("onednn", "auto")):
        model = models.get("gpt", input_shape=(128,), num_classes=4096, size="mini", conv=conv)
        assert model.config.attention == name, model.config.attention  # "auto": oneDNN's where usable
        params, model_state = jax.jit(model.init)(jax.random.key(0))
        batch = jax.device_put(model.example_batch(32))

        def sgd_step(carry, b, loss_fn=model.loss_fn):
            p, s = carry
            (value, (s, _)), g = jax.value_and_grad(lambda p: loss_fn(p, s, b, None), has_aux=True)(p)
            return (jax.tree.map(lambda p, g: p - 0.2 * g, p, g), s), {"loss": value}

        runs[name] = harness.Timed(jax.jit(sgd_step, donate_argnums=0), (params, model_state), batch)
        harness.warm_up(runs[name], 2)
    harness.interleave(runs.values(), 3, repeats)
    print(f"\nthe mini GPT's step (hand-written SGD, batch 32, one device): XLA's attention {runs['xla'].median:.1f} "
          f"ms, oneDNN's products {runs['onednn'].median:.1f} ms; paired oneDNN/XLA "
          f"{harness.paired(runs['onednn'], runs['xla']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
