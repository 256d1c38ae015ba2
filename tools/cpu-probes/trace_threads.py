"""jaxtrain's ResNet-18 step (batch 64) traced with jax.profiler, its threads side by side: per step, how long both,
one or none of XLA's threads run an operation, and how long a thread waits in a collective while the other computes
(docs/performance.md, "Host memory"). Gaps with no thread busy are listed with where they fall in the step.
    python tools/cpu-probes/trace_threads.py [DEVICES]
"""

import collections
import glob
import gzip
import json
import sys
import tempfile

import jaxtrain as jt

devices = jt.setup_devices(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
import jax
import optax

from jaxtrain import models
from jaxtrain.train.timing import time_steps

STEPS = 3
model = models.get("resnet18")
trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.2), mesh=jt.make_mesh(devices))
state = trainer.init(*jax.jit(model.init)(jax.random.key(0)))
batch = trainer.shard(model.example_batch(64))
state, _ = time_steps(trainer, state, batch, 3)
trace_dir = tempfile.mkdtemp(prefix="jaxtrain-trace-")
with jax.profiler.trace(trace_dir):
    state, _ = time_steps(trainer, state, batch, STEPS)
events = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans  # the steps the trace holds whole
               if e["name"] == "CommonPjRtLoadedExecutable::Execute (jit_step)")
steps = [(a, b) for a, b in steps if b - a > 0.5 * max(b - a for a, b in steps)]  # not a step cut by the trace
start, end = steps[0][0], steps[-1][1]
print("steps (start, ms):", [(round((a - start) / 1000), round((b - a) / 1000)) for a, b in steps])
COLLECTIVE = ("all-reduce", "psum", "Rendezvous", "Wait")
# leaf operations and collectives on XLA's threads (the pool's and the devices' launch threads), as +1/-1 edges
edges = []
for e in spans:
    if ("XLA" in names.get((e["pid"], e["tid"]), "")) and not e["name"].startswith("ThunkExecutor"):
        kind = e["name"].startswith(COLLECTIVE)
        edges += [(e["ts"], kind, 1), (e["ts"] + e["dur"], kind, -1)]
edges.sort()
running, waiting, last, time_in = 0, 0, edges[0][0], collections.Counter()
gaps = []
for t, kind, d in edges:
    a, b = max(last, start), min(t, end)
    if b > a:
        state_now = ("both threads compute" if running >= 2 else "one computes, one waits in a collective"
                     if running == 1 and waiting else "one computes, the other idle" if running == 1
                     else "all in collectives" if waiting else "nothing runs")
        time_in[state_now] += b - a
        if state_now == "nothing runs" and b - a > 300:
            gaps.append((a - max(s for s, _ in steps if s <= a), b - a))
    if kind:
        waiting += d
    else:
        running += d
    last = t
print(f"{len(steps)} steps traced whole, {(end - start) / 1000 / len(steps):.1f} ms each; per step:")
for k, v in time_in.most_common():
    print(f"  {v / 1000 / len(steps):8.1f} ms  {k}")
print("gaps with nothing running (ms into the step, ms):", [(round(a / 1000, 1), round(d / 1000, 1)) for a, d in gaps])
