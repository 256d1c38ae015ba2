"""Scaling on paper: one step compiled per GPU count (8 GPUs per host beyond 8), its time ESTIMATED.

    rows = scaling("a100", [1, 2, 4, 8, 16, 32, 64], mode="weak", model="resnet50", batch_size=256, ...)
    print(format_scaling(rows)); plot(rows, "scaling.png")

``mode="strong"``: the global batch stays ``batch_size``; ``"weak"``: each GPU keeps ``batch_size`` examples.
Efficiency is per-GPU throughput against the first count's; the communication share is the collectives' time
over the step's (hidden or not). Estimates, never measurements.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxtrain.errors import ConfigError
from jaxtrain.gpu.targets import target

MODES = ("strong", "weak")


def topology(gpu: str, count: int) -> tuple[int, int]:
    """(GPUs per host, hosts) for ``count`` GPUs: one host up to a node's size, whole nodes beyond."""
    per_host = target(gpu).gpus_per_host
    if count <= per_host:
        return count, 1
    if count % per_host:
        raise ConfigError(f"{count} GPUs: beyond one node ({per_host} GPUs) use whole nodes (a multiple of {per_host})")
    return per_host, count // per_host


def scaling(gpu: str, counts: list[int], mode: str = "weak", *, batch_size: int,
            progress: Callable[[str], None] | None = None, **settings) -> list[dict]:
    """One row per GPU count: the step compiled for it (``gpu.plan``, no batch search) and its estimate."""
    from jaxtrain.gpu.plan import plan

    if mode not in MODES:
        raise ConfigError(f"unknown scaling mode {mode!r}: choose one of {', '.join(MODES)}")
    if settings.get("mesh"):
        raise ConfigError("scaling varies the data axis over the GPU counts: leave the mesh out")
    if not counts or sorted(set(counts)) != list(counts):
        raise ConfigError(f"GPU counts {counts}: give increasing counts, e.g. 1,2,4,8,16")
    rows = []
    for count in counts:
        gpus, hosts = topology(gpu, count)
        batch = batch_size if mode == "strong" else batch_size * count
        if batch % count:
            raise ConfigError(f"strong scaling: the global batch {batch} does not split over {count} GPUs")
        p = plan(gpu, gpus, hosts, largest_batch=False, progress=progress, batch_size=batch, **settings)
        e = p.estimate
        rows.append({"gpus": count, "hosts": hosts, "batch": batch, "per_gpu_batch": batch // count,
                     "seconds": e["seconds"], "examples_per_second": e["examples_per_second"],
                     "per_gpu": e["examples_per_second"] / count, "mfu": e["mfu"], "hfu": e["hfu"],
                     "communication_share": e["communication"] / e["seconds"],
                     "exposed_share": e["exposed"] / e["seconds"], "bottleneck": e["bottleneck"],
                     "memory_bytes": p.memory["total"], "fits": p.fits})
    for row in rows:
        row["efficiency"] = row["per_gpu"] / rows[0]["per_gpu"]
    return rows


def format_scaling(rows: list[dict], title: str = "") -> str:
    head = (f"{'GPUs':>5} {'hosts':>5} {'batch':>7} {'/GPU':>5} {'step':>10} {'examples/s':>11} {'per GPU':>8} "
            f"{'efficiency':>10} {'comm':>6} {'exposed':>7} {'MFU':>5} {'HFU':>5}  bottleneck")
    lines = [title, head] if title else [head]
    for r in rows:
        lines.append(f"{r['gpus']:>5} {r['hosts']:>5} {r['batch']:>7,} {r['per_gpu_batch']:>5,} "
                     f"{r['seconds'] * 1e3:>7.2f} ms {r['examples_per_second']:>11,.0f} {r['per_gpu']:>8,.0f} "
                     f"{r['efficiency']:>10.1%} {r['communication_share']:>6.1%} {r['exposed_share']:>7.1%} "
                     f"{'n/a' if r['mfu'] is None else format(r['mfu'], '.0%'):>5} {r['hfu']:>5.0%}  "
                     f"{r['bottleneck']}{'' if r['fits'] else ' (DOES NOT FIT)'}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Per-GPU throughput, efficiency and communication share against the GPU count, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r["gpus"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(gpus, [r["per_gpu"] for r in rows], "o-")
    left.set(xscale="log", xlabel="GPUs", ylabel="examples/s per GPU (estimate)", ylim=(0, None))
    right.plot(gpus, [100 * r["efficiency"] for r in rows], "o-", label="scaling efficiency")
    right.plot(gpus, [100 * r["communication_share"] for r in rows], "s--", label="communication share")
    right.plot(gpus, [100 * r["exposed_share"] for r in rows], "^:", label="exposed communication")
    right.set(xscale="log", xlabel="GPUs", ylabel="% (estimate)", ylim=(0, 105))
    right.legend()
    for ax in (left, right):
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.grid(alpha=0.3)
    fig.suptitle(title or "estimated scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
