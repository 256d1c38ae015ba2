"""The mini GPT's matrix products alone: XLA:CPU's (under jaxtrain's CPU flags, one device with all cores) against
PyTorch's on the same cores, median ms and GFLOP/s of each (docs/language-models.md, "Where the gap is").

    .venv/bin/python tools/cpu-probes/gpt_dots.py TORCH_PYTHON [REPEATS]

The shapes are the step's for batch 32 x 128 tokens (4096 rows), width 256, MLP 1024, vocabulary 4096: the
query/key/value and MLP products, the logits, and their gradients (the weight gradients contract over the 4096
tokens). Each side runs in its own process (PyTorch in TORCH_PYTHON, which needs no JAX), the two alternating
three times (this shared host's speed drifts: one round alone can be 2x off on a shape).
"""

import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = [(4096, 256, 768), (4096, 256, 1024), (4096, 1024, 256), (4096, 256, 4096), (4096, 4096, 256),
          (256, 4096, 4096), (256, 4096, 1024), (1024, 4096, 256)]  # M x K x N
ROUNDS = 3  # each side's process runs this many times, the two alternating; each figure the median of the rounds'


def median_ms(f, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``f``, in ms, after two untimed ones (the other probes' too)."""
    f()
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def side(name: str, repeats: int) -> dict:
    out = {}
    if name == "torch":
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        for m, k, n in SHAPES:
            a, b = torch.rand(m, k), torch.rand(k, n)
            out[f"{m}x{k}x{n}"] = median_ms(lambda: a @ b, repeats)
        return out
    import jaxtrain as jt

    jt.setup_devices(1)
    import jax
    import numpy as np

    for m, k, n in SHAPES:
        a, b = (jax.device_put(np.random.rand(*s).astype(np.float32)) for s in ((m, k), (k, n)))
        f = jax.jit(lambda a, b: a @ b)
        out[f"{m}x{k}x{n}"] = median_ms(lambda: f(a, b).block_until_ready(), repeats)
    return out


def alternated(script: str, torch_python: str, repeats: str) -> tuple[dict, dict]:
    """``script --side xla|torch REPEATS`` run ``ROUNDS`` times each, the two alternating (XLA's in this
    interpreter, PyTorch's in ``torch_python``): the median of the rounds' figures, per key, of each side (each
    side's process prints a JSON dict last). gpt_attention.py's too."""
    def run(python, name):
        done = subprocess.run([python, script, "--side", name, repeats], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
        return json.loads(done.stdout.strip().splitlines()[-1])

    rounds = [(run(sys.executable, "xla"), run(torch_python, "torch")) for _ in range(ROUNDS)]
    return tuple({key: statistics.median(r[i][key] for r in rounds) for key in rounds[0][i]} for i in (0, 1))


def main(argv) -> int:
    if argv[0] == "--side":
        print(json.dumps(side(argv[1], int(argv[2]))))
        return 0
    xla, torch = alternated(sys.argv[0], argv[0], argv[1] if len(argv) > 1 else "15")
    print("| M x K x N | XLA:CPU ms | GFLOP/s | PyTorch ms | GFLOP/s | PyTorch / XLA speed |")
    print("|---|---|---|---|---|---|")
    for key, ms in xla.items():
        m, k, n = map(int, key.split("x"))
        gflop = 2 * m * k * n / 1e9
        print(f"| {key} | {ms:.2f} | {gflop / ms * 1e3:.0f} | {torch[key]:.2f} | {gflop / torch[key] * 1e3:.0f} | "
              f"{ms / torch[key]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
