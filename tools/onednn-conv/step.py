"""ResNet-18's train step (batch 64, plain SGD, hand-written jit) with XLA's convolutions or oneDNN's (dconv).

    python tools/onednn-conv/step.py [--dnnl] [--repeats 6] [--devices N --strategy shard_map]

Prints the first 3 losses and the median ms/step of REPEATS blocks of 3 steps. Run it once per mode, in separate
processes, alternating (the VM is noisy). Without --devices: a hand-written jit step on one device. With it:
jaxtrain's own step (make_train_step) on N devices; use --strategy shard_map there, where each device calls the
custom calls on its own share (under jit, XLA's partitioner would gather the batch for them). A prototype for
issue 36, not part of jaxtrain.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
p = argparse.ArgumentParser()
p.add_argument("--dnnl", action="store_true")
p.add_argument("--repeats", type=int, default=6)
p.add_argument("--devices", type=int, default=None)
p.add_argument("--strategy", default="shard_map")
args = p.parse_args()

import jaxtrain as jt  # noqa: E402

devices = jt.setup_devices(args.devices or 1)
import jax  # noqa: E402
from flax import nnx  # noqa: E402

if args.dnnl:  # every nnx.Conv built from here on convolves with oneDNN
    from dconv import conv_general_dilated

    _init = nnx.Conv.__init__

    def init(self, *a, **k):
        _init(self, *a, **k)
        self.conv_general_dilated = conv_general_dilated

    nnx.Conv.__init__ = init

from jaxtrain import models  # noqa: E402

model = models.get("resnet18")
params, model_state = jax.jit(model.init)(jax.random.key(0))
batch = jax.device_put(model.example_batch(64))


def step(carry, b):
    params, model_state = carry
    (loss, (model_state, _)), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, model_state, b, None)
    return (jax.tree.map(lambda p, g: p - 0.2 * g, params, grads), model_state), loss


if args.devices:  # jaxtrain's step
    import optax

    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.2), mesh=jt.make_mesh(devices), strategy=args.strategy)
    batch = trainer.shard(model.example_batch(64))

    def f(state, b):
        state, metrics = trainer(state, b)
        return state, metrics["loss"]

    carry = trainer.init(params, model_state)
else:
    f = jax.jit(step, donate_argnums=0)
    carry = (params, model_state)
losses = []
for _ in range(3):
    carry, loss = f(carry, batch)
    losses.append(float(loss))
times = []
for _ in range(args.repeats):
    time.sleep(0.3)
    start = time.perf_counter()
    for _ in range(3):
        carry, loss = f(carry, batch)
    loss.block_until_ready()
    times.append((time.perf_counter() - start) / 3 * 1000)
print(
    "oneDNN" if args.dnnl else "XLA",
    "losses",
    [f"{x:.6f}" for x in losses],
    f"ms/step median {statistics.median(times):.1f}",
    [round(t) for t in times],
)
