"""oneDNN's time per ResNet-18 step (batch 64, 1 device) by primitive kind, from ONEDNN_VERBOSE=1: 2 steps after
the compile, summed and halved (docs/performance.md, "oneDNN convolutions", the layouts table). Set
JAXTRAIN_ONEDNN_BLOCKED=1 for the blocked layouts everywhere.
    python tools/cpu-probes/onednn_verbose.py
"""

import collections
import os
import subprocess
import sys

if os.environ.get("ONEDNN_VERBOSE") != "1":  # the parent: run the step with verbose output and sum it
    out = subprocess.run([sys.executable, __file__], env=dict(os.environ, ONEDNN_VERBOSE="1"), capture_output=True,
                         text=True, check=True).stdout
    totals = collections.Counter()
    for line in out.splitlines():
        if line.startswith("onednn_verbose,") and ",exec,cpu," in line:
            fields = line.split(",")
            kind = fields[3] if fields[3] == "reorder" else f"{fields[3]} {fields[5]}"
            totals[kind] += float(fields[-1]) / 2
    for kind, ms in totals.most_common():
        print(f"{ms:8.1f} ms  {kind}")
    print(f"{sum(totals.values()):8.1f} ms  all")
    sys.exit(0)

import jaxtrain as jt

devices = jt.setup_devices(1)
import jax
import optax

from jaxtrain import models

model = models.get("resnet18", conv="onednn")
trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices))
state = trainer.init(*jax.jit(model.init)(jax.random.key(0)))
batch = trainer.shard(model.example_batch(64))
for _ in range(2):
    state, _ = trainer(state, batch)
jax.block_until_ready(state)
