"""Can XLA:CPU run int8 faster than fp32 here? Each int8 layer of LeNet and ResNet-18, timed alone.

    python -m experiments.bench_int8 [--batch-size 256] [--resnet-batch 64] [--repeats 30] [--json F]

For each layer shape (LeNet's two convolutions and two dense layers at the batch size; three ResNet-18
3x3 convolutions at batch 64), in one process:

- ``fp32``: the float layer under jaxtrain's CPU flags (convolutions and dots to XLA's Eigen kernels);
- ``int8, training flags``: int8 x int8 -> int32 (qwix, an activation scale per example) compiled like the
  training step. Eigen has no int8 kernels: XLA widens the operands to int32 first;
- ``int8, YNNPACK``: the same program jitted as ``jaxtrain.analysis.quantize`` jits its int8 programs (``int8_jit``:
  the per-jit options ``compat.int8_compiler_options``): convolutions and dots to YNNPACK's int8 kernels;
- ``quantise only``: the activation's rounding to int8 alone (its share of the int8 layer).

"LeNet conv2 as one GEMM" is conv2's im2col product (patches [B x 81, 500] by [500, 50]) without the patches'
cost: the floor of any int8 formulation of conv2 that goes through a matrix product.

Prints a markdown table (ms, median of the repeats; the CPU's vector ISA in the title).
"""

from __future__ import annotations

import argparse
import sys

from experiments import harness, print_and_save
from jaxtrain.cli import one_line_errors, positive_int

DN = ("NHWC", "HWIO", "NHWC")


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_int8", __doc__, steps=None, repeats=30, json_out="the figures")
    p.add_argument("--batch-size", type=positive_int, default=256, help="LeNet's batch")
    p.add_argument("--resnet-batch", type=positive_int, default=64, help="ResNet-18's batch")
    return p


def layers(batch: int, resnet_batch: int = 64) -> dict:
    """{name: (kind, activation shape, weight shape)}: LeNet at ``batch``, ResNet-18's 3x3 convs at
    ``resnet_batch`` (padded inputs, VALID: Fashion-MNIST's 28x28, 7x7 and 4x4 outputs)."""
    return {"LeNet conv1": ("conv", (batch, 28, 28, 1), (3, 3, 1, 20)),
            "LeNet conv2": ("conv", (batch, 13, 13, 20), (5, 5, 20, 50)),
            "LeNet conv2 as one GEMM (im2col)": ("dot", (batch * 81, 500), (500, 50)),
            "LeNet dense1": ("dot", (batch, 800), (800, 128)),
            "LeNet dense2": ("dot", (batch, 128), (128, 10)),
            "ResNet-18 stage 1 conv": ("conv", (resnet_batch, 30, 30, 64), (3, 3, 64, 64)),
            "ResNet-18 stage 3 conv": ("conv", (resnet_batch, 9, 9, 256), (3, 3, 256, 256)),
            "ResNet-18 stage 4 conv": ("conv", (resnet_batch, 6, 6, 512), (3, 3, 512, 512))}


def measure(args) -> dict:
    import jax
    import numpy as np
    import qwix
    from jax import lax

    import jaxtrain as jt
    from jaxtrain.analysis.quantize import int8_jit
    from jaxtrain.core import compat
    from jaxtrain.nn.int8 import int8_act, int8_weight

    jt.setup_devices(1)
    rng = np.random.default_rng(0)
    float_op = {"conv": lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=DN),
                "dot": lambda x, w: x @ w}
    int8_op = {"conv": lambda x, w: qwix.conv_general_dilated(int8_act(x), w, (1, 1), "VALID", dimension_numbers=DN),
               "dot": lambda x, w: qwix.dot_general(int8_act(x), w, (((1,), (0,)), ((), ())))}
    rows = {}
    for name, (kind, xs, ws) in layers(args.batch_size, args.resnet_batch).items():
        x = jax.device_put(rng.random(xs, np.float32))
        w = jax.device_put((rng.standard_normal(ws) * 0.1).astype(np.float32))
        qw = int8_weight(w)
        rows[name] = harness.take_turns({"fp32": harness.Call(jax.jit(float_op[kind]), (x, w)),
                                         "int8, training flags": harness.Call(jax.jit(int8_op[kind]), (x, qw)),
                                         "int8, YNNPACK": harness.Call(int8_jit(int8_op[kind]), (x, qw)),
                                         "quantise only": harness.Call(int8_jit(lambda a: int8_act(a).qvalue), (x,))},
                                        args.repeats, in_a_row=True)
        harness.progress(f"measured {name}")
    return {"cpu_isa": compat.cpu_isa(), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "options": compat.int8_compiler_options(), "ms": rows}


def table(r: dict) -> str:
    names = list(next(iter(r["ms"].values())))
    lines = [f"int8 layers on XLA:CPU ({r['cpu_isa'] or 'ISA unknown'}), jax {r['jax']}: ms, median", "",
             "| layer | " + " | ".join(names) + " | best int8 / fp32 |", "|---" * (len(names) + 2) + "|"]
    for layer, ms in r["ms"].items():
        best = min(ms["int8, training flags"], ms["int8, YNNPACK"])
        lines.append(f"| {layer} | " + " | ".join(f"{ms[k]:.2f}" for k in names) + f" | {best / ms['fp32']:.2f} |")
    return "\n".join(lines)


@one_line_errors("bench_int8")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    result = measure(args)
    return print_and_save(table(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
