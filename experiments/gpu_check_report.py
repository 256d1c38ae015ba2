"""``experiments.gpu_check``'s Markdown report: one section per part, every figure beside its estimate; and the
GPU runs kept in docs/gpu-runs/ (one report.json per run, named DATE-GPU.json), which the docs and
``experiments.gpu_validate`` read their measured figures from."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

RUNS = Path(__file__).resolve().parent.parent / "docs" / "gpu-runs"
TRANSCRIBED = "transcribed from the run's log; report not kept"  # how a run whose report.json was lost is marked


def kept_runs(folder: Path = RUNS) -> dict[str, dict]:
    """Every GPU run kept in ``folder``, by name (DATE-GPU), oldest first."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))}


def run_header(parts: dict) -> dict:
    """A kept report's ``run``: the day its env part was measured and the GPU kind it found (the file's name is
    DATE-GPU: ``2026-11-27-h100``)."""
    from jaxtrain.errors import ConfigError
    from jaxtrain.gpu.targets import for_device

    env = parts.get("env") or {}
    kind = for_device(env["devices"][0]) if env.get("devices") and env.get("date") else None
    if kind is None:
        raise ConfigError("--keep: the report has no env part of a known GPU kind: run the check with --part env")
    return {"date": env["date"], "gpu": kind.key, "source": "experiments.gpu_check's report.json, as written"}


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped / errors of a pytest ``--junitxml`` file (zeros where pytest wrote none), and the
    figures the tests recorded (``record_property``: a benchmark's figure is reported, not asserted)."""
    if not Path(path).exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": [], "figures": {}}
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    figures = {f"{c.get('name')}: {p.get('name')}": p.get("value") for c in cases for p in c.iter("property")}
    failed = [c for c in cases if c.find("failure") is not None]
    errors = [c for c in cases if c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {"passed": len(cases) - len(failed) - len(errors) - len(skipped), "failed": len(failed),
            "skipped": len(skipped), "errors": len(errors),
            "failures": [f"{c.get('name')}: {_message(c)}" for c in failed + errors], "figures": figures}


def _message(case) -> str:
    """A failed (or errored) test case's message: its first 300 characters."""
    found = case.find("failure")
    return (found if found is not None else case.find("error")).get("message", "")[:300]


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def _num(x, fmt) -> str:
    return "n/a" if x is None else format(x, fmt)


def _model(r: dict) -> str:
    """The row's model: a language model with its size."""
    return f"{r['model']} {r['model_size']}" if r.get("model_size") else r["model"]


def _speed(r: dict) -> str:
    """examples/s; a language model's tokens/s beside them."""
    tokens = f" ({r['tokens_per_second']:,.0f} tokens/s)" if r.get("tokens_per_second") else ""
    return f"{r['examples_per_second']:,.0f}{tokens}"


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
            f"| {_model(r)} | {r['precision']} | {r['remat']} | {r['batch']} | {r['ms']:.2f} | "
            f"{_speed(r)} | {_num(r.get('estimate_ms'), '.2f')} | "
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


def buffers_table(modes: dict) -> list[str]:
    """A model's step per K (rows) under each command-buffer mode (columns), each mode over XLA's own where that
    ran, and what each run's XLA_FLAGS left the command buffers."""
    failed = [f"- {mode}: FAILED: {r['error']}" for mode, r in modes.items() if "error" in r]
    ran = {mode: {row["k"]: row for row in r["rows"]} for mode, r in modes.items() if "rows" in r}
    if not ran:
        return failed
    names, base = list(ran), ran.get("xla")
    ratios = [m for m in names if m != "xla"] if base else []
    header = [f"{m} ms/step" for m in names] + [f"{m}/xla" for m in ratios]
    lines = ["| K | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for k in ran[names[0]]:
        steps = ran[names[0]][k]["steps_per_call"]
        cells = [f"{ran[m][k]['ms_per_step']:.3f}" for m in names]
        cells += [f"{ran[m][k]['ms_per_step'] / base[k]['ms_per_step']:.3f}" for m in ratios]
        lines.append(f"| {k}{f' ({steps})' if k == 'auto' else ''} | " + " | ".join(cells) + " |")
    work = ", ".join(f"{m} {modes[m]['work_ms_per_step']:.3f}" for m in names)
    left = "; ".join(f"{m}: {modes[m].get('command_buffers', 'not recorded')}" for m in names)
    return lines + ["", f"The device's work a step (ms): {work}. What each run's XLA_FLAGS left the command "
                    f"buffers: {left}."] + failed


def markdown(parts: dict) -> str:
    out = ["# jaxtrain on a GPU: experiments.gpu_check", ""]
    if any(p.get("dry_run") for p in parts.values()):
        out += ["**DRY RUN** on the CPU backend with tiny shapes: no figure here is a GPU's.", ""]
    env = parts.get("env")
    if env:
        out += ["## Machine", "", f"- devices: {', '.join(env['devices'])} ({env['backend']})",
                f"- nvidia-smi: {env['nvidia_smi']}", f"- Python {env['python']}, {env['cores']} cores",
                "- packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v),
                *[f"- XLA: `{line}`" for line in env.get("xla_command_buffer_flags", [])], ""]
    tests = parts.get("tests")
    if tests:
        out += ["## pytest -m gpu", "", f"`{tests['command']}`: {tests['passed']} passed, {tests['failed']} failed, "
                f"{tests['errors']} errors, {tests['skipped']} skipped (exit {tests['returncode']}, "
                f"{tests['seconds']:.0f} s)", ""] + [f"- {f}" for f in tests["failures"]]
        out += [f"- figure, {k}: {v}" for k, v in tests.get("figures", {}).items()] + [""]
    for name, title in (("steps", "Train steps"), ("remat", "Remat policies (bf16)")):
        if name in parts:
            out += [f"## {title}", "", "Step time: median of the timed blocks, on one generated batch already on "
                    "the device. ESTIMATE: `jaxtrain.gpu.estimate` of the same compiled program for this GPU kind. "
                    "MFU: 3 x the model's forward FLOPs (`jaxtrain.models.flops`) per example x examples/s over the "
                    "dense peak; "
                    "HFU: the compiled program's FLOPs instead (every trip of a loop counted; a cuDNN attention's "
                    "FLOPs are not). A GPT's row: GPT-2 124M's target is 450K tokens/s and 40% MFU on one H100 "
                    "(modded-nanogpt's and llm.c's per-GPU rate).", "",
                    step_table(parts[name]["rows"]), ""]
    e2e = parts.get("e2e")
    if e2e:
        out += ["## What users run: steps per call and the data on the device", "",
                "`experiments.bench_busy`: LeNet's step per K against the device's work alone (what one more step "
                "adds to a call), then each experiment from the command line, one step a call with host data beside "
                "auto steps a call with the data on the device (epochs after the first; busy: steps x the device's "
                "work per step over the epoch's wall time).", ""]
        for name, result in e2e.items():
            if isinstance(result, dict):
                out += [f"### {name}", ""]
                out += ([f"FAILED: {result['error']}"] if "error" in result else
                        ["```", result["table"].strip(), "```"]) + [""]
    buffers = parts.get("buffers")
    if buffers:
        out += ["## Command buffers (CUDA graphs)", "",
                "`experiments.bench_busy steps` under each `JAXTRAIN_COMMAND_BUFFERS` mode, each in its own process: "
                "xla (XLA's own choice, the default), off (none), loops (XLA's own plus loops and "
                "conditionals). Milliseconds per step in calls of K steps; what the host launches in each mode: "
                "`python -m experiments.command_buffers`.", ""]
        for model, modes in buffers.items():
            if isinstance(modes, dict):
                out += [f"### {model}", "", *buffers_table(modes), ""]
    kernels = parts.get("kernels")
    if kernels:
        out += ["## Pallas kernels against XLA's jnp versions", ""]
        out += ([f"FAILED: {kernels['error']}"] if "error" in kernels else ["```", kernels["table"].strip(), "```"])
        out += [""]
    return "\n".join(out)
