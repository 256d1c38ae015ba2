"""BatchNorm's statistics, flax's synchronised ones (two all-reduces each way per layer) vs jaxtrain's
(``jaxtrain.nn.batch_stats``: one, none in their backward): ResNet-18's train step (batch 64, SGD, the default
convolutions) compiled both ways in one process, timed in alternating blocks of 3 steps; the median of the
per-pair ratios, and the all-reduces in each compiled step (docs/performance.md, "BatchNorm's collectives").
    python tools/cpu-probes/bn_collectives.py [DEVICES] [PAIRS]
"""

import statistics
import sys

import jaxtrain as jt

devices = jt.setup_devices(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
import jax
import optax

from jaxtrain import models
from jaxtrain.kernels import onednn
from jaxtrain.models import resnet
from jaxtrain.train.timing import time_steps

model = models.get("resnet18")
conv = onednn.choose(model.conv)[1]


def build(stats):
    loss_fn = resnet.adapter(conv=conv, batch_stats=stats).loss_fn
    trainer = jt.make_train_step(loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices))
    state = trainer.init(*jax.jit(model.init)(jax.random.key(0)))
    batch = trainer.shard(model.example_batch(64))
    all_reduces = trainer.lower(state, batch).compile().as_text().count(" all-reduce(")
    state, _ = time_steps(trainer, state, batch, 2)
    return [trainer, state, batch, all_reduces]


runs = {stats: build(stats) for stats in ("flax", "jaxtrain")}
times = {stats: [] for stats in runs}
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 12):
    for stats in (("flax", "jaxtrain") if i % 2 else ("jaxtrain", "flax")):
        run = runs[stats]
        run[1], sec = time_steps(run[0], run[1], run[2], 3)
        times[stats].append(1000 * sec)
ratios = [a / b for a, b in zip(times["flax"], times["jaxtrain"])]
print(f"ResNet-18, batch 64, {len(devices)} devices, {model.conv} convolutions")
for stats, run in runs.items():
    print(f"{stats:9s} statistics: {statistics.median(times[stats]):7.1f} ms/step (median), {run[3]} all-reduces")
print(f"flax/jaxtrain, the median of {len(ratios)} paired ratios: {statistics.median(ratios):.3f} "
      f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
