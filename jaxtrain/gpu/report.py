"""A ``GpuPlan`` as the text ``python -m experiments.gpu_plan`` prints."""

from __future__ import annotations

from jaxtrain.gpu.targets import target


def size(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _flops(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.1f} us"


def utilisation(e: dict) -> str:
    """"MFU 40% (HFU 52%)": the model's FLOPs and the program's over the peak (``jaxtrain.models.flops``)."""
    mfu = "MFU n/a" if e.get("mfu") is None else f"MFU {e['mfu']:.0%}"
    return f"{mfu} (HFU {e['hfu']:.0%})"


def format_estimate(e: dict) -> list[str]:
    """An estimate's summary (``Estimate.summary()``) as report lines."""
    lines = [f"step time ESTIMATED from the program (not measured): {_time(e['seconds'])} expected, "
             f"{_time(e['lower_bound'])} lower bound; {e['examples_per_second']:,.0f} examples/s, "
             f"{utilisation(e)}; bottleneck: {e['bottleneck']}",
             f"  kernels bound by compute {_time(e['compute'])}, by memory {_time(e['memory'])}; launches "
             f"{_time(e['launch'])}; collectives {_time(e['communication'])}, "
             f"{e['overlapped_share']:.0%} of it assumed hidden behind kernels (exposed {_time(e['exposed'])})",
             "  costliest ops:"]
    if e.get("to_host") or e.get("from_host"):
        lines.insert(2, f"  host transfers (offloaded remat values): {size(e['to_host'])} to the host, "
                        f"{size(e['from_host'])} back per step: {_time(e['host_seconds'])} on the host link, beside "
                        f"the kernels; they waited {_time(e['host_wait'])} for it")
    for o in e["costliest"]:
        lines.append(f"    {o['name'][:36]:<36} {o['kind']:<14} {o['label'][:24]:<24} {_time(o['seconds']):>10} "
                     f" {_flops(o['flops']):>13} {size(o['bytes']):>12}  {o['bound']}-bound")
    return lines


def format_plan(p) -> str:
    t, s, m = target(p.gpu), p.settings, p.memory
    mesh = s.get("mesh") or {"data": p.gpus * p.hosts}
    head = (f"{s['model']} on {p.hosts} x {p.gpus} {t.name} (mesh {', '.join(f'{k}={v}' for k, v in mesh.items())}): "
            f"{s['precision']}, strategy {s['strategy']}, params {s['param_sharding']}, accum {s['accum_steps']}"
            f"{' (' + s['accum'] + ')' if s['accum_steps'] > 1 else ''}, remat {s['remat']}")
    lines = [head, f"batch: {p.call_batch:,} per call, {p.per_gpu_batch:,} per GPU; compiled in "
                   f"{p.compile_seconds:.1f} s (nothing autotuned: no figure below is a GPU time)", "",
             "memory per GPU:",
             f"  arguments {size(m['arguments'])}  (params {size(m['params'])}, optimizer state "
             f"{size(m['optimizer_state'])}, model state {size(m['model_state'])}, batch {size(m['batch'])})",
             f"  outputs   {size(m['outputs'])}, of them aliased to the donated state {size(m['aliased'])} "
             f"(donation {'kept' if p.donation_kept else 'NOT kept: the new state needs memory of its own'})",
             f"  temps     {size(m['temps'])}",
             *([f"  host      {size(m['host'])} in the host's pinned memory (offloaded remat values; "
                f"not in the total)"] if m.get("host") else []),
             f"  total     {size(m['total'])} of {size(p.budget_bytes)} ({p.memory_fraction:.0%} of "
             f"{t.memory_gb:g} GB, JAX's default share): {'FITS' if p.fits else 'DOES NOT FIT'}"]
    if p.largest_batch is not None:
        shards = p.call_batch // p.per_gpu_batch
        at_least = "at least " if p.largest_batch >= p.max_batch else ""
        per_gpu = p.largest_batch // shards
        lines.append(f"  largest call batch that fits: {at_least}{p.largest_batch:,} ({per_gpu:,} per GPU, "
                     f"{size(p.largest_batch_bytes)}; {len(p.search)} compiles"
                     f"{'; the search stops there' if at_least else ''})")
    elif p.search == [] and not p.fits:
        lines.append("  not even the smallest batch fits: shard the state (param_sharding fsdp) or use more GPUs")
    peak = t.peak_flops(s["precision"])
    lines += ["", f"compute per GPU: {_flops(p.flops)} per step"
                  + (f" ({_time(p.flops / peak)} at the {s['precision']} dense peak, {peak / 1e12:,.0f} "
                     "TFLOP/s: a lower bound, not an estimate)" if p.flops else ""),
              f"  bytes accessed (XLA's cost analysis): {size(p.bytes_accessed)}", "", "collectives per GPU:"]
    if not p.collectives:
        lines.append("  none")
    for c in p.collectives:
        lines.append(f"  {c['kind']:<19} x{c['count']:<4} {size(c['bytes']):>12}  "
                     f"{'async' if c['async'] else 'sync'}{', inside a loop' if c['in_loop'] else ''}")
    if p.estimate:
        lines += [""] + format_estimate(p.estimate)
    k = p.kernels
    cudnn = ", ".join(f"{name} x{n}" for name, n in k["cudnn"].items()) or "none"
    lines += ["", "kernels:", f"  cuDNN: {cudnn}",
              f"  cuBLAS gemms {k['cublas_gemms']}, Triton gemm fusions {k['triton_gemm_fusions']}, "
              f"Pallas kernels {k['pallas_kernels']}"
              + "".join(f" ({n} {b})" for b, n in k.get("pallas_backends", {}).items()) + f", fusions {k['fusions']}"]
    if k["other_custom_calls"]:
        lines.append("  other custom calls: " + ", ".join(f"{n} x{c}" for n, c in k["other_custom_calls"].items()))
    return "\n".join(lines)
