"""A run's train step on THIS machine's devices: compiled, timed on generated batches, its memory, and the
estimate ``jaxtrain.gpu`` makes for the same program on the same GPU kind (``experiments.gpu_check``).

    from jaxtrain.gpu import measure
    row = measure.step(model="resnet50", precision="bf16", batch_size=256, input_shape=(224, 224, 3),
                       num_classes=1000)
    row["ms"], row["estimate_ms"], row["peak_bytes"], row["memory_analysis"]

The program timed is the one compiled and estimated (``trainer.lower(...).compile()``: one compile), called on
one generated batch already on the devices, so the step alone is timed, never the input pipeline.
"""

from __future__ import annotations

import statistics
import time

from jaxtrain.gpu.targets import for_device


def _peak_bytes(devices) -> int | None:
    stats = [d.memory_stats() for d in devices]
    return None if any(s is None for s in stats) else max(s.get("peak_bytes_in_use", 0) for s in stats)


def step(*, steps: int = 20, repeats: int = 5, input_shape: tuple | None = None, num_classes: int | None = None,
         estimate_as: str | None = None, dump_dir: str | None = None, **settings) -> dict:
    """One row: the step a run with ``settings`` (``RunConfig`` fields) trains, on every local device.

    ``steps`` steps per timed block, ``repeats`` blocks after one warm-up block: ``ms`` is the median block's
    time per step. ``estimate_as``: the GPU kind to estimate for (default: the devices' own kind; on a CPU
    there is none and the estimate is left out unless named). ``dump_dir``: ``analysis.compile_lowered``'s."""
    import jax

    from jaxtrain.gpu import analysis
    from jaxtrain.gpu.estimate import estimate
    from jaxtrain.gpu.plan import run_step
    from jaxtrain.gpu.targets import target
    from jaxtrain.parallel.devices import make_mesh
    from jaxtrain.driver.config import RunConfig

    devices = jax.local_devices()
    c = RunConfig(devices=len(devices), **settings)
    shape, model, trainer, call = run_step(c, make_mesh(devices, axes=c.mesh), input_shape, num_classes)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(c.seed))
    batch = trainer.shard(model.example_batch(call))
    compiled, compile_s, flops, bytes_accessed = analysis.compile_lowered(trainer.lower(state, batch), dump_dir)

    def block(state, n):
        start = time.perf_counter()
        for _ in range(n):
            state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])  # waits for the last step, so for all of them
        return state, (time.perf_counter() - start) / n, loss

    state, _, first_loss = block(state, steps)  # warm-up: the first calls, the allocator's first pools
    times = []
    for _ in range(repeats):
        state, seconds, loss = block(state, steps)
        times.append(seconds)
    seconds = statistics.median(times)
    kind = devices[0].device_kind
    t = target(estimate_as) if estimate_as else for_device(kind)
    row = {"model": c.model, "precision": c.precision, "remat": c.remat, "strategy": c.strategy,
           "devices": len(devices), "device_kind": kind, "batch": call, "input_shape": list(shape["input_shape"]),
           "num_classes": shape["num_classes"], "ms": seconds * 1e3, "spread_ms": [min(times) * 1e3, max(times) * 1e3],
           "examples_per_second": call / seconds, "compile_s": compile_s, "flops": flops,
           **({"model_size": c.model_size, "tokens_per_second": call * c.seq_len / seconds} if c.seq_len else {}),
           "bytes_accessed": bytes_accessed, "loss": [first_loss, loss], "peak_bytes": _peak_bytes(devices),
           "memory_analysis": analysis.memory(compiled), "target": t.key if t else None}
    if t is not None:
        from jaxtrain.models.flops import forward, utilisation

        model_flops = forward(c.model, shape["input_shape"], shape["num_classes"], c.model_size)
        e = estimate(compiled.as_text(), t, len(devices), 1, call, model_flops).summary()
        peak = t.peak_flops(c.precision) * len(devices)
        row.update(estimate_ms=e["seconds"] * 1e3, estimate_bottleneck=e["bottleneck"], peak_flops=peak,
                   time_ratio=seconds / e["seconds"], model_flops_per_example=model_flops, estimate_mfu=e["mfu"],
                   **utilisation(model_flops, flops and flops * len(devices), call, seconds, peak))
        if row["peak_bytes"]:
            row["memory_ratio"] = row["peak_bytes"] / row["memory_analysis"]["total"]
    return row
