"""jaxtrain's train step alone (make_train_step, SGD): median ms over 8 blocks, for A/B runs in alternating
processes (docs/performance.md, "oneDNN convolutions": --conv, JAXTRAIN_ONEDNN_THREADS, JAXTRAIN_ONEDNN_BLOCKED).
    python tools/cpu-probes/step_time.py DEVICES [lenet|resnet18] [auto|xla|onednn]
"""

import statistics
import sys

import jaxtrain as jt

devices = jt.setup_devices(int(sys.argv[1]))
import jax
import optax

from jaxtrain import models
from jaxtrain.train.timing import time_steps

model = models.get(sys.argv[2] if len(sys.argv) > 2 else "resnet18", conv=sys.argv[3] if len(sys.argv) > 3 else "auto")
batch_size, steps = (64, 3) if model.name == "resnet18" else (256, 10)
trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices))
state = trainer.init(*jax.jit(model.init)(jax.random.key(0)))
batch = trainer.shard(model.example_batch(batch_size))
state, _ = time_steps(trainer, state, batch, 3)  # compile + warm up
times = []
for _ in range(8):
    state, sec = time_steps(trainer, state, batch, steps)
    times.append(1000 * sec)
print(f"{model.name}, {model.conv} convolutions, {len(devices)} devices: median {statistics.median(times):.1f} ms "
      f"(min {min(times):.1f}, max {max(times):.1f})")
