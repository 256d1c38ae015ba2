"""Minor page faults and system time per train step (ResNet-18, batch 64), jaxtrain's or PyTorch's, in this process's
malloc settings (docs/performance.md, "Host memory"):
    python tools/cpu-probes/page_faults.py DEVICES [BLOCKS] [auto|xla]   # jaxtrain, keeping freed memory (host_memory)
    JAXTRAIN_MALLOC=default python tools/cpu-probes/page_faults.py DEVICES   # glibc's defaults (or its MALLOC_* ones)
    python tools/cpu-probes/page_faults.py torch               # PyTorch (experiments.bench's worker)
    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=-1 python ... torch   # with jaxtrain's
"""

import os
import resource
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # experiments.bench_torch

if sys.argv[1] == "torch":
    from experiments.bench_torch import TorchWorker

    worker = TorchWorker("resnet18", 64)  # the child inherits this environment (MALLOC_*)
    stat = f"/proc/{worker._proc.pid}/stat"

    def counters():  # minor faults, system s, user s, RSS MiB of the child (proc(5): fields 10, 15, 14, 24)
        f = open(stat).read().rsplit(")", 1)[1].split()
        return int(f[7]), int(f[12]) / 100, int(f[11]) / 100, int(f[21]) / 256

    def block():
        return worker.time(3)
else:
    import jaxtrain as jt

    devices = jt.setup_devices(int(sys.argv[1]))
    import jax
    import optax

    from jaxtrain import models
    from jaxtrain.parallel import host_memory
    from jaxtrain.train.timing import time_steps

    print("malloc keeps freed memory:", host_memory.applied())
    model = models.get("resnet18", conv=sys.argv[3] if len(sys.argv) > 3 else "auto")
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(devices))
    state = trainer.init(*jax.jit(model.init)(jax.random.key(0)))
    batch = trainer.shard(model.example_batch(64))

    def counters():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_minflt, r.ru_stime, r.ru_utime, int(open("/proc/self/statm").read().split()[1]) / 256

    def block():
        global state
        state, sec = time_steps(trainer, state, batch, 3)
        return sec

block()  # compile, warm up, grow the heap
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
    a = counters()
    sec = block()
    b = counters()
    print(f"{1000 * sec:.0f} ms/step, minor faults/step {(b[0] - a[0]) / 3:,.0f} (~{(b[0] - a[0]) / 3 / 256:.0f} MiB "
          f"of 4 KiB pages), system {(b[1] - a[1]) / 3:.3f} s/step, user {(b[2] - a[2]) / 3:.3f} s/step, "
          f"RSS {b[3]:,.0f} MiB")
if sys.argv[1] != "torch":
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB")
else:
    worker.close()
