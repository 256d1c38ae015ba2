"""Where the LeNet step's time goes: each operation timed alone, XLA:CPU vs PyTorch.

    python -m experiments.bench_ops [--batch-size 256] [--xla-defaults] [--json F]

Every operation of the d2l LeNet train step (forward convolutions, their
weight- and input-gradient convolutions, ReLU+pooling both ways, the dense
layers both ways, loss, SGD update, gradient all-reduce) is compiled alone
and timed on one device with the whole machine's threads (the all-reduce on
two devices), each one's repeats in a row. PyTorch (if installed) times the
same operations in a child process. Prints a markdown table; the sum of the
parts is comparable with the step times of ``experiments.bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments import harness
from jaxtrain.cli import one_line_errors, positive_int


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_ops", __doc__, steps=None, repeats=30, json_out="the figures")
    p.add_argument("--batch-size", type=positive_int, default=256)
    p.add_argument("--xla-defaults", action="store_true", help="XLA's default CPU flags instead of jaxtrain's")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if it is installed")
    p.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)  # the child process
    return p


def jax_ops(batch: int) -> dict:
    """{op: harness.Call} for XLA:CPU."""
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxtrain as jt
    from jaxtrain.models import lenet

    dev = jax.devices()[0]
    rng = np.random.default_rng(0)

    def put(*shape):  # uniform [0, 1) values on the device
        return jax.device_put(rng.random(shape, np.float32), dev)

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def pool(a):
        return lenet._avg_pool2(jax.nn.relu(a))

    x1, w1, a1 = put(batch, 28, 28, 1), put(3, 3, 1, 20), put(batch, 26, 26, 20)
    x2, w2, a2 = put(batch, 13, 13, 20), put(5, 5, 20, 50), put(batch, 9, 9, 50)
    h, wd1, wd2, hid = put(batch, 800), put(800, 128), put(128, 10), put(batch, 128)
    labels = jax.device_put(rng.integers(0, 10, batch).astype(np.int32), dev)
    params = jax.device_put(lenet.init_params(jax.random.key(0)), dev)
    opt = optax.sgd(0.2)
    opt_state = opt.init(params)

    def vjp_of(f, primal, cot):
        return jax.vjp(f, primal)[1](cot)[0]

    ops = {
        "conv1 forward": (lambda x, w: conv(x, w), x1, w1),
        "conv1 weight-grad": (lambda x, g: vjp_of(lambda w: conv(x, w), w1, g), x1, a1),
        "relu+pool1 forward": (pool, a1),
        "relu+pool1 backward": (lambda a, g: vjp_of(pool, a, g), a1, x2),
        "conv2 forward": (lambda x, w: conv(x, w), x2, w2),
        "conv2 input-grad": (lambda w, g: vjp_of(lambda x: conv(x, w), x2, g), w2, a2),
        "conv2 weight-grad": (lambda x, g: vjp_of(lambda w: conv(x, w), w2, g), x2, a2),
        "relu+pool2 forward": (pool, a2),
        "relu+pool2 backward": (lambda a, g: vjp_of(pool, a, g), a2, put(batch, 4, 4, 50)),
        "dense forward (both)": (lambda h, w1_, w2_: jax.nn.relu(h @ w1_) @ w2_, h, wd1, wd2),
        "dense backward (both)": (lambda h, w1_, w2_, g: jax.vjp(lambda a, b: jax.nn.relu(h @ a) @ b, w1_, w2_)[1](g),
                                  h, wd1, wd2, put(batch, 10)),
        "loss forward+backward": (lambda z, y: jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(
            z, y).mean())(z), hid[:, :10], labels),
        "SGD update": (lambda p, s, g: optax.apply_updates(p, opt.update(g, s, p)[0]), params, opt_state, params),
    }
    out = {name: harness.Call(jax.jit(f), tuple(args)) for name, (f, *args) in ops.items()}
    mesh = jt.make_mesh(2)  # main() set up 2 devices
    size = sum(x.size for x in jax.tree.leaves(params))
    grads = jax.device_put(np.ones((2 * size,), np.float32), NamedSharding(mesh, P(jt.DATA_AXIS)))
    psum = jax.jit(jax.shard_map(lambda g: lax.psum(g, jt.DATA_AXIS), mesh=mesh, in_specs=P(jt.DATA_AXIS),
                                 out_specs=P(jt.DATA_AXIS)))
    out["gradient all-reduce (2 devices)"] = harness.Call(psum, (grads,))
    return out


def torch_ops(batch: int) -> dict:
    """{op: harness.Call} for PyTorch (the child process)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(len(os.sched_getaffinity(0)))

    def r(*shape):
        return torch.rand(*shape)

    x1, w1, a1 = r(batch, 1, 28, 28), r(20, 1, 3, 3), r(batch, 20, 26, 26)
    x2, w2, a2 = r(batch, 20, 13, 13), r(50, 20, 5, 5), r(batch, 50, 9, 9)
    h, wd1, wd2 = r(batch, 800), r(128, 800), r(10, 128)
    labels = torch.randint(0, 10, (batch,))
    grad, aten = torch.nn.grad, torch.ops.aten
    r1, r2 = F.relu(a1), F.relu(a2)
    pre, hid = F.linear(h, wd1), F.relu(F.linear(h, wd1))

    def pool_bwd(a, r, g):  # what autograd runs: avg_pool2d_backward, then threshold_backward (ReLU)
        return aten.threshold_backward(aten.avg_pool2d_backward(g, r, [2, 2], [2, 2], [0, 0], False, True, None), a, 0)

    def dense_bwd(g):
        dh = aten.threshold_backward(g @ wd2, pre, 0)
        return g.t() @ hid, g.sum(0), dh.t() @ h, dh.sum(0)

    def loss_bwd():
        z = r(batch, 10).requires_grad_()
        F.cross_entropy(z, labels).backward()

    net = [torch.zeros_like(p).requires_grad_() for p in (w1, w2, wd1, wd2)]
    for p in net:
        p.grad = torch.ones_like(p)
    sgd = torch.optim.SGD(net, lr=0.2)
    ops = {
        "conv1 forward": lambda: F.conv2d(x1, w1),
        "conv1 weight-grad": lambda: grad.conv2d_weight(x1, w1.shape, a1),
        "relu+pool1 forward": lambda: F.avg_pool2d(F.relu(a1), 2),
        "relu+pool1 backward": lambda: pool_bwd(a1, r1, x2),
        "conv2 forward": lambda: F.conv2d(x2, w2),
        "conv2 input-grad": lambda: grad.conv2d_input(x2.shape, w2, a2),
        "conv2 weight-grad": lambda: grad.conv2d_weight(x2, w2.shape, a2),
        "relu+pool2 forward": lambda: F.avg_pool2d(F.relu(a2), 2),
        "relu+pool2 backward": lambda: pool_bwd(a2, r2, r(batch, 50, 4, 4)),
        "dense forward (both)": lambda: F.linear(F.relu(F.linear(h, wd1)), wd2),
        "dense backward (both)": lambda: dense_bwd(r(batch, 10)),
        "loss forward+backward": loss_bwd,
        "SGD update": sgd.step,
    }
    return {name: harness.Call(f, synchronous=True) for name, f in ops.items()}


@one_line_errors("bench_ops")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.torch_only:
        print(json.dumps(harness.take_turns(torch_ops(args.batch_size), args.repeats, warm=2, in_a_row=True)))
        return 0
    if args.xla_defaults:
        os.environ["JAXTRAIN_XLA_DEFAULTS"] = "1"
    import jaxtrain as jt

    jt.setup_devices(2)
    import jax

    from experiments import bench_torch

    torch_ms = {}
    if bench_torch.available() and not args.no_torch:  # first, while no XLA thread is alive yet
        out = subprocess.run([sys.executable, "-m", "experiments.bench_ops", "--torch-only", "--batch-size",
                              str(args.batch_size), "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        torch_ms = json.loads(out.stdout.strip().splitlines()[-1])
    xla_ms = harness.take_turns(jax_ops(args.batch_size), args.repeats, warm=2, in_a_row=True)
    flags = "XLA defaults" if args.xla_defaults else "jaxtrain's flags"
    print(f"\nLeNet operations alone, batch {args.batch_size}, one device with all cores ({flags}), "
          f"jax {jax.__version__}; median of {args.repeats} calls, ms\n")
    print("| operation | XLA:CPU | PyTorch |\n|---|---|---|")
    for name, ms in xla_ms.items():
        t = torch_ms.get(name)
        print(f"| {name} | {ms:.2f} | {'n/a' if t is None else f'{t:.2f}'} |")
    if torch_ms:
        common = [k for k in xla_ms if k in torch_ms]
        print(f"| sum (ops both have) | {sum(xla_ms[k] for k in common):.1f} | "
              f"{sum(torch_ms[k] for k in common):.1f} |")
    else:
        print(f"| sum | {sum(xla_ms.values()):.1f} | n/a |")
    harness.write_json(args.json, {"batch_size": args.batch_size, "flags": flags, "jax": jax.__version__,
                                   "xla_ms": xla_ms, "torch_ms": torch_ms or None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
