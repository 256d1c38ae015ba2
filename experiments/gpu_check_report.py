"""``experiments.gpu_check``'s Markdown report: one section per part, every figure beside its estimate."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped / errors of a pytest ``--junitxml`` file (zeros where pytest wrote none)."""
    if not Path(path).exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": []}
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None]
    errors = [c for c in cases if c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {"passed": len(cases) - len(failed) - len(errors) - len(skipped), "failed": len(failed),
            "skipped": len(skipped), "errors": len(errors),
            "failures": [f"{c.get('name')}: {_message(c)}" for c in failed + errors]}


def _message(case) -> str:
    """A failed (or errored) test case's message: its first 300 characters."""
    found = case.find("failure")
    return (found if found is not None else case.find("error")).get("message", "")[:300]


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def _num(x, fmt) -> str:
    return "n/a" if x is None else format(x, fmt)


def step_table(rows: list[dict]) -> str:
    lines = ["| model | precision | remat | batch | ms/step | examples/s | ESTIMATE ms | measured/estimate | "
             "MFU | HFU | peak memory | memory_analysis | measured/analysis | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('model')} | {r.get('precision')} | {r.get('remat', 'none')} | FAILED: "
                         f"{r['error'].replace('|', '/')} ||||||||||")
            continue
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['remat']} | {r['batch']} | {r['ms']:.2f} | "
            f"{r['examples_per_second']:,.0f} | {_num(r.get('estimate_ms'), '.2f')} | "
            f"{_num(r.get('time_ratio'), '.2f')} | {_num(r.get('mfu'), '.1%')} | {_num(r.get('hfu'), '.1%')} | "
            f"{_mib(r.get('peak_bytes'))} | {_mib(r['memory_analysis']['total'])} | "
            f"{_num(r.get('memory_ratio'), '.2f')} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def prediction_table(gpu: str, rows: list[dict]) -> str:
    lines = [f"| model | precision | remat | batch | ESTIMATE ms on one {gpu.upper()} | examples/s | MFU | HFU | "
             "memory_analysis | bottleneck |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['precision']} | {r['remat']} | {r['batch']} | {r['estimate_ms']:.2f} | "
                     f"{r['examples_per_second']:,.0f} | {_num(r['mfu'], '.1%')} | {r['hfu']:.1%} | "
                     f"{_mib(r['memory_analysis'])} | {r['bottleneck']} |")
    return "\n".join(lines)


def markdown(parts: dict) -> str:
    out = ["# jaxtrain on a GPU: experiments.gpu_check", ""]
    if any(p.get("dry_run") for p in parts.values()):
        out += ["**DRY RUN** on the CPU backend with tiny shapes: no figure here is a GPU's.", ""]
    env = parts.get("env")
    if env:
        out += ["## Machine", "", f"- devices: {', '.join(env['devices'])} ({env['backend']})",
                f"- nvidia-smi: {env['nvidia_smi']}", f"- Python {env['python']}, {env['cores']} cores",
                "- packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v), ""]
    tests = parts.get("tests")
    if tests:
        out += ["## pytest -m gpu", "", f"`{tests['command']}`: {tests['passed']} passed, {tests['failed']} failed, "
                f"{tests['errors']} errors, {tests['skipped']} skipped (exit {tests['returncode']}, "
                f"{tests['seconds']:.0f} s)", ""] + [f"- {f}" for f in tests["failures"]] + [""]
    for name, title in (("steps", "Train steps"), ("remat", "Remat policies (bf16)")):
        if name in parts:
            out += [f"## {title}", "", "Step time: median of the timed blocks, on one generated batch already on "
                    "the device. ESTIMATE: `jaxtrain.gpu.estimate` of the same compiled program for this GPU kind. "
                    "MFU: 3 x the model's forward FLOPs (`jaxtrain.models.flops`) per example x examples/s over the "
                    "dense peak; "
                    "HFU: the compiled program's FLOPs instead (XLA counts a loop's body once: the ViT's is low).", "",
                    step_table(parts[name]["rows"]), ""]
    kernels = parts.get("kernels")
    if kernels:
        out += ["## Pallas kernels against XLA's jnp versions", ""]
        out += ([f"FAILED: {kernels['error']}"] if "error" in kernels else ["```", kernels["table"].strip(), "```"])
        out += [""]
    return "\n".join(out)
