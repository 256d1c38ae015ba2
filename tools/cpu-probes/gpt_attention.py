"""The mini GPT's causal attention alone (batch 32, 128 tokens, 4 heads of 64): XLA:CPU's (under jaxtrain's CPU flags,
one device with all cores) against PyTorch's on the same cores, median ms of each (docs/language-models.md, "Where
the gap is").

    .venv/bin/python tools/cpu-probes/gpt_attention.py TORCH_PYTHON [REPEATS]

Rows: the two batched products of the attention (the scores q k^T and probabilities x v: 128 products of
128x64x128 each), each also on one thread (XLA: its Eigen threads off for that program; PyTorch:
``torch.set_num_threads(1)``); the attention's forward (``jax.nn.dot_product_attention`` against
``scaled_dot_product_attention``, both causal, inputs [B, T, H, C] as the GPT holds them) and its forward and
backward (the gradients of q, k and v). Each side runs in its own process, the two alternating three times.
"""

import json
import os
import sys

from gpt_dots import alternated, median_ms  # beside this script

B, T, H, C = 32, 128, 4, 64
ROWS = ("scores q k^T", "scores, one thread", "probabilities x v", "probabilities x v, one thread",
        "attention forward", "attention forward + backward")


def torch_side(repeats: int) -> dict:
    import torch

    cores = len(os.sched_getaffinity(0))
    q, k, v = (torch.rand(B, H, T, C) for _ in range(3))
    p = torch.rand(B, H, T, T)
    qt, kt, vt = (torch.rand(B, T, H, C, requires_grad=True) for _ in range(3))

    def attention():
        return torch.nn.functional.scaled_dot_product_attention(qt.transpose(1, 2), kt.transpose(1, 2),
                                                                vt.transpose(1, 2), is_causal=True)

    def both():
        torch.autograd.grad(attention().sum(), (qt, kt, vt))

    out = {}
    for threads, suffix in ((cores, ""), (1, ", one thread")):
        torch.set_num_threads(threads)
        out["scores" + (suffix or " q k^T")] = median_ms(lambda: q @ k.transpose(-1, -2), repeats)
        out["probabilities x v" + suffix] = median_ms(lambda: p @ v, repeats)
    torch.set_num_threads(cores)
    with torch.no_grad():
        out["attention forward"] = median_ms(attention, repeats)
    out["attention forward + backward"] = median_ms(both, repeats)
    return out


def xla_side(repeats: int) -> dict:
    import jaxtrain as jt

    jt.setup_devices(1)
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v = (jax.device_put(rng.random((B, H, T, C), np.float32)) for _ in range(3))
    p = jax.device_put(rng.random((B, H, T, T), np.float32))
    qt, kt, vt = (jax.device_put(rng.random((B, T, H, C), np.float32)) for _ in range(3))
    one = {"xla_cpu_multi_thread_eigen": False}

    def timed(fn, *args, options=None):
        f = jax.jit(fn, compiler_options=options)
        return median_ms(lambda: jax.block_until_ready(f(*args)), repeats)

    def scores(q, k):
        return jnp.einsum("bhtc,bhsc->bhts", q, k)

    def weighted(p, v):
        return jnp.einsum("bhts,bhsc->bhtc", p, v)

    def attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    return {"scores q k^T": timed(scores, q, k), "scores, one thread": timed(scores, q, k, options=one),
            "probabilities x v": timed(weighted, p, v),
            "probabilities x v, one thread": timed(weighted, p, v, options=one),
            "attention forward": timed(attention, qt, kt, vt),
            "attention forward + backward": timed(jax.grad(lambda *a: attention(*a).sum(), argnums=(0, 1, 2)),
                                                  qt, kt, vt)}


def main(argv) -> int:
    if argv[0] == "--side":
        side = torch_side if argv[1] == "torch" else xla_side
        print(json.dumps(side(int(argv[2]))))
        return 0
    xla, torch = alternated(sys.argv[0], argv[0], argv[1] if len(argv) > 1 else "20")
    gflop = 2 * B * H * T * T * C / 1e9  # one batched product
    print(f"| batch {B}, {T} tokens, {H} heads of {C} | XLA:CPU ms | PyTorch ms | PyTorch / XLA speed |")
    print("|---|---|---|---|")
    for key in ROWS:
        rate = f" ({gflop / xla[key] * 1e3:.0f} and {gflop / torch[key] * 1e3:.0f} GFLOP/s)" if key in ROWS[:4] else ""
        print(f"| {key}{rate} | {xla[key]:.2f} | {torch[key]:.2f} | {xla[key] / torch[key]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
