"""The "data transfer is the slow part" lesson: n x n matmul with and without copies.

    python -m experiments.transfer [--sizes 200,1000,2000] [--out DIR]

For each n: numpy on the host; JAX with both operands already on the device;
JAX copying both operands to the device and the result back every time.
Prints ms, GFLOP/s and ratios, and saves transfer.png.
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain.cli import positive_int, whole_numbers


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.transfer", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=whole_numbers(1, "200,1000"), default="200,1000,2000",
                   help="comma-separated matrix sizes n")
    p.add_argument("--repeats", type=positive_int, default=20, help="timed repeats per variant (median reported)")
    p.add_argument("--out", default=None, help="directory for transfer.png (default: a fresh runs/transfer-...)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    sizes = args.sizes
    import jax
    import numpy as np

    from jaxtrain.driver.outputs import make_out_dir
    from jaxtrain.train.timing import median_seconds

    device = jax.local_devices()[0]
    matmul = jax.jit(lambda a, b: a @ b)
    rows = []
    for n in sizes:
        rng = np.random.default_rng(n)
        a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
        a_dev, b_dev = jax.device_put(a, device), jax.device_put(b, device)
        t_numpy = median_seconds(lambda: a @ b, args.repeats)
        t_resident = median_seconds(lambda: matmul(a_dev, b_dev).block_until_ready(), args.repeats)
        t_copy = median_seconds(
            lambda: np.asarray(matmul(jax.device_put(a, device), jax.device_put(b, device))), args.repeats)
        flops = 2 * n**3
        rows.append((n, t_numpy, t_resident, t_copy, flops))

    print(f"\nn x n float32 matmul on {device.platform} ({device.device_kind}), jax {jax.__version__}, "
          f"median of {args.repeats}\n")
    print("| n | numpy ms | JAX resident ms | JAX + copies ms | numpy GFLOP/s | resident GFLOP/s | "
          "copies GFLOP/s | numpy / resident | copies / resident |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, tn, tr, tc, fl in rows:
        print(f"| {n} | {1e3 * tn:.3f} | {1e3 * tr:.3f} | {1e3 * tc:.3f} | {fl / tn / 1e9:.1f} | {fl / tr / 1e9:.1f} | "
              f"{fl / tc / 1e9:.1f} | {tn / tr:.2f}x | {tc / tr:.2f}x |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = make_out_dir(args.out, "transfer")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, label in enumerate(("numpy (host)", "JAX, operands resident", "JAX, copy in and out each time")):
        ax.plot([r[0] for r in rows], [r[4] / r[1 + i] / 1e9 for r in rows], "o-", label=label)
    ax.set_xlabel("n")
    ax.set_ylabel("GFLOP/s")
    ax.set_xscale("log")
    ax.set_title(f"n x n matmul on {device.platform}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "transfer.png", dpi=100)
    print(f"\nwrote {out_dir / 'transfer.png'}")
    return 0


if __name__ == "__main__":
    from jaxtrain.cli import library_log

    with library_log():  # the library's log lines, as a command line says them
        sys.exit(main())
