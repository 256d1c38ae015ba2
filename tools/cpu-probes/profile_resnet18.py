"""jaxtrain's ResNet-18 step (batch 64, make_train_step) under jax.profiler: 3 steps traced, the time per op and
per kind of op (relayouts are transpose_copy_fusion; convolutions are mostly not named in the trace).
    python tools/cpu-probes/profile_resnet18.py [DEVICES]
"""

import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time

import jaxtrain as jt

devices = jt.setup_devices(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
import jax
import optax

from jaxtrain import models
from jaxtrain.train.timing import time_steps

mesh = jt.make_mesh(devices)
model = models.get("resnet18")
params0, ms0 = jax.jit(model.init)(jax.random.key(0))
host = model.example_batch(64)
tr = jt.make_train_step(model.loss_fn, optax.sgd(0.2), mesh=mesh)
state = tr.init(params0, ms0)
batch = tr.shard(host)
state, _ = time_steps(tr, state, batch, 3)
t = time.perf_counter()
state, _ = time_steps(tr, state, batch, 3)
print("ms/step", (time.perf_counter() - t) / 3 * 1000)
d = tempfile.mkdtemp(prefix="jaxtrain-trace-")
with jax.profiler.trace(d):
    state, _ = time_steps(tr, state, batch, 3)
f = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
ev = json.load(gzip.open(f))["traceEvents"]
tot = collections.Counter()
cnt = collections.Counter()
for e in ev:
    if e.get("ph") == "X" and "dur" in e:
        tot[e["name"]] += e["dur"]
        cnt[e["name"]] += 1
for n, v in tot.most_common(60):
    print(f"{v / 3000:9.2f} ms  x{cnt[n] // 3:3d}  {n[:100]}")
cat = collections.Counter()
for n, v in tot.items():
    if n.startswith("$") or "ThunkExecutor" in n or "Pjit" in n or "np.asarray" in n:
        continue
    cat[re.sub(r"\.\d+$", "", n)] += v
print("---- by kind")
for n, v in cat.most_common(40):
    print(f"{v / 3000:9.2f} ms {n}")
print("sum", sum(cat.values()) / 3000)
