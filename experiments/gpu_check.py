"""The day a GPU is available: every GPU number jaxtrain claims, measured, beside what it estimated.

    make gpu-bundle                              # here, on the CPU host: the wheels the GPU machine lacks
    python -m experiments.gpu_check              # there: every part, in commands of at most 10 minutes
    python -m experiments.gpu_check --dry-run    # here: every part on the CPU backend with tiny shapes

Parts (``--part NAME``, repeatable; default: all), each cached in ``OUT/parts/NAME.json`` so that the next call
goes on where the last one stopped (``--again`` measures them anew):

- ``env``: the machine, driver, jax and the packages;
- ``tests``: ``pytest -m gpu`` (tests/test_gpu.py);
- ``steps``: LeNet, ResNet-18, ResNet-50 (224x224, 256 and 400 per GPU) and the ViT, fp32 and bf16: step time,
  examples/s, MFU and HFU, peak device memory, beside ``jaxtrain.gpu``'s estimate and ``memory_analysis`` for the
  same kind;
- ``remat``: the remat policies with host offload (``experiments.gpu_offload``'s table; ResNet-50's none and
  full), measured;
- ``kernels``: the Pallas kernels against XLA's jnp versions (``experiments.bench_kernels``);
- ``e2e``: what users run (``experiments.bench_busy``): LeNet's step at 1, 8, 64 and ``auto`` steps per call
  against its device work alone, and the d2l LeNet (10 epochs) and ResNet-18 (``E2E_EPOCHS``) from the command
  line on Fashion-MNIST (the bundle's copy: ``make gpu-bundle``), today's path (host data, one step a call)
  beside the new one (the data on the device, ``auto`` steps a call): seconds per epoch, test accuracy, data wait,
  the GPU's busy share;
- ``buffers``: XLA's command buffers (CUDA graphs), each JAXTRAIN_COMMAND_BUFFERS mode (xla, off, loops) in its own
  process: LeNet's and ResNet-18's step per K (``BUFFERS``), the modes side by side.

Writes ``OUT/report.json`` and ``OUT/report.md`` (default OUT: ``gpu-check/``) and prints where; ``--keep DIR``
(``make gpu-check``: docs/gpu-runs) also writes them as ``DIR/DATE-GPU.json`` and ``.md``, the run's record to
commit, which the docs and ``experiments.gpu_validate`` read. On a machine without a GPU it says so in one line
and exits 2, unless ``--dry-run``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import gpu_check_report as report
from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.errors import ConfigError
from jaxtrain.io.files import atomic_write

PARTS = ("env", "e2e", "buffers", "tests", "steps", "remat", "kernels")
RESNET50 = {"input_shape": (224, 224, 3), "num_classes": 1000}  # ImageNet's images, gpu_validate's network
GPT2 = {"model_size": "124m", "vocab_size": 50257}  # GPT-2's tokenizer's vocabulary (a BPE of that size)
STEPS = [  # (settings, per-GPU batch or None for the recipe's)
    ({"model": "lenet", "precision": "fp32"}, None), ({"model": "lenet", "precision": "bf16"}, None),
    ({"model": "resnet18", "precision": "fp32"}, None), ({"model": "resnet18", "precision": "bf16"}, None),
    ({"model": "resnet50", "precision": "bf16", **RESNET50}, 256), ({"model": "vit", "precision": "bf16"}, None),
    ({"model": "resnet50", "precision": "bf16", **RESNET50}, 400),  # MLPerf Training's 400 per GPU (v3.0, v4.0)
    ({"model": "gpt", "precision": "bf16", **GPT2}, 16),  # GPT-2 124M, windows of 1024: issue 67's 450K tokens/s
    ({"model": "gpt", "precision": "bf16", **GPT2}, 32),
]
DRY = {"input_shape": (32, 32, 3), "num_classes": 10}  # ResNet-50 on the CPU: tiny images
DRY_GPT = {"model_size": "tiny", "vocab_size": 512}  # the GPT on the CPU: a tiny one


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--part", action="append", choices=PARTS, help="only these parts (repeatable; default: all)")
    p.add_argument("--out", default="gpu-check", help="the report's folder (parts are cached in OUT/parts)")
    p.add_argument("--keep", metavar="DIR", help="also write the report as DIR/DATE-GPU.json and .md, to commit "
                                                  "(make gpu-check: docs/gpu-runs)")
    p.add_argument("--again", action="store_true", help="measure the parts asked for anew, cached or not")
    p.add_argument("--dry-run", action="store_true",
                   help="rehearse every part on the CPU backend with tiny shapes (estimates as for an H100)")
    p.add_argument("--budget", type=positive_int, default=240,
                   help="seconds after which no new part starts: commands there stop at 10 minutes, and the longest "
                        "part took 5 on an H200 (tests)")
    p.add_argument("--predict", metavar="GPU", help="instead: the estimate's predictions for one GPU of this kind "
                                                     "(h100, h200, ...) for every row measured, compiled on this host "
                                                     "(the gpu-compile extra; no GPU needed)")
    p.add_argument("--steps", type=positive_int, default=20, help="steps per timed block")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed blocks per step (median reported)")
    return p


# Outside --dry-run every child runs on the GPU or fails (JAX unpinned would fall back to the CPU with a warning);
# the CPU backend beside it counts a module's FLOPs (jaxtrain.gpu.analysis).
def on_gpu(args) -> dict:
    return {} if args.dry_run else {"JAX_PLATFORMS": "cuda,cpu"}


DEVICES = "import jax, json; print(json.dumps([jax.default_backend(), [d.device_kind for d in jax.devices()]]))"


def xla_flags_help(pattern: str = "command_buffer", env: dict | None = None) -> list[str]:
    """The lines of ``XLA_FLAGS=--help`` (as this jaxlib and its GPU plugin print them, defaults included) that name
    ``pattern``: the command-buffer (CUDA graph) flags' names and defaults move between jaxlib versions
    (docs/gpu-busy.md), so the GPU's own list is recorded before any is set."""
    env = {**(os.environ if env is None else env), "XLA_FLAGS": "--help"}
    out = subprocess.run([sys.executable, "-c", DEVICES], capture_output=True, text=True, env=env)
    return [" ".join(line.split()) for line in (out.stdout + out.stderr).splitlines() if pattern in line]


def last_line(out: subprocess.CompletedProcess) -> str:
    """What a failed child said last: its stderr's last line, or its exit status where it said nothing."""
    return (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]


@functools.cache  # one child process per check, not one per row
def devices_seen() -> tuple[str, list[str]]:
    """The backend and the device kinds JAX finds, asked in a child process: this one never touches a GPU, since
    JAX preallocates 75% of a GPU's memory in the first process that does, which would leave the rows a quarter."""
    out = subprocess.run([sys.executable, "-c", DEVICES], capture_output=True, text=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1])) if out.returncode == 0 else ("none", [])


def part_env(args) -> dict:
    import platform
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True) if not args.dry_run else None
    except OSError:  # no nvidia-smi: the report says None
        smi = None
    names = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax", "chex", "orbax-checkpoint",
             "numpy", "grain", "tensorflow-datasets", "qwix", "optuna", "torch")
    backend, kinds = devices_seen()
    return {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "cores": os.cpu_count(),
            "backend": backend,
            "devices": kinds, "packages": {n: version(n) for n in names},
            "nvidia_smi": (smi.stdout.strip() if smi and smi.returncode == 0 else None),
            "xla_command_buffer_flags": xla_flags_help("command_buffer", {**os.environ, **on_gpu(args)})}


def part_tests(args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the suite pins itself to CPUs (conftest);
    junit = Path(args.out) / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "-o", "addopts=-ra --strict-markers"]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return {"returncode": out.returncode, "seconds": time.perf_counter() - start, "command": " ".join(cmd[1:]),
            **report.junit_counts(junit), "tail": out.stdout[-3000:] + out.stderr[-1000:]}


ROW = "import json, sys; from jaxtrain.gpu import measure; print(json.dumps(measure.step(**json.loads(sys.argv[1]))))"


def _step_rows(args, settings_list, say) -> list[dict]:
    """One process per row: its peak device memory is its own (JAX keeps one peak per process), and a row that
    runs out of memory or crashes is a finding in the report, not the end of the check."""
    rows = []
    for settings, per_gpu in settings_list:
        settings = dict(settings)
        if args.dry_run:
            settings.update(batch_size=8, **({"resnet50": DRY, "gpt": DRY_GPT}.get(settings["model"], {})))
        elif per_gpu:
            settings["batch_size"] = per_gpu * len(devices_seen()[1])
        say(f"  {settings['model']} {settings['precision']} remat {settings.get('remat', 'none')}")
        key = json.dumps({"remat": "none", **settings}, sort_keys=True)
        if args.dry_run and key in _REHEARSED:  # a rehearsal's tiny shapes make some rows one: measured once
            rows.append(_REHEARSED[key])
            continue
        kw = {**settings, "steps": 2 if args.dry_run else args.steps, "repeats": 1 if args.dry_run else args.repeats,
              "estimate_as": "h100" if args.dry_run else None,
              "dump_dir": str(Path(args.out, "dumps", "-".join(str(v) for v in settings.values()).replace("/", "_")))}
        # The row's own compilation cache, empty: its first process compiles (and dumps the module its FLOPs are
        # counted from; jax leaves xla_dump_to out of the cache key, so another row's entry could serve it).
        jit_cache = Path(args.out, "jit-cache", Path(kw["dump_dir"]).name)
        shutil.rmtree(jit_cache, ignore_errors=True)
        cache = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(jit_cache), **on_gpu(args),
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
        first = subprocess.run([sys.executable, "-c", ROW, json.dumps(kw)], capture_output=True, text=True, env=cache)
        # Again, from the cache: the peak memory of a process that runs the step and never compiled it (a compile's
        # autotuning takes device memory of its own); the times of the two agree or the report shows both. Not in a
        # rehearsal: a CPU reports no device memory, and the second process would only double CI's leg.
        again = not (first.returncode or args.dry_run)
        out = subprocess.run([sys.executable, "-c", ROW, json.dumps(kw)], capture_output=True, text=True,
                             env=cache) if again else first
        shutil.rmtree(kw["dump_dir"], ignore_errors=True)
        if out.returncode == 0:
            row = json.loads(out.stdout.strip().splitlines()[-1])
            before = json.loads(first.stdout.strip().splitlines()[-1])
            rows.append({**row, "compile_s": before["compile_s"], "cached_compile_s": row["compile_s"],
                         # the second process compiled nothing (no dump: no FLOPs), else its memory includes a compile
                         "memory_without_compile": row["flops"] is None,
                         "flops": before["flops"],  # the cached process compiled nothing: no dump to count
                         "hfu": before["flops"] * row["devices"] / (row["ms"] / 1e3) / row["peak_flops"]
                         if before.get("flops") and row.get("peak_flops") else None,
                         "first_process": {k: before[k] for k in ("ms", "peak_bytes")}})
        else:
            last = last_line(out)
            rows.append({**{k: v for k, v in settings.items() if k in ("model", "precision", "remat")},
                         "error": last[:500], "stderr_tail": out.stderr[-2000:]})
        _REHEARSED[key] = rows[-1]
    return rows


_REHEARSED: dict[str, dict] = {}  # a rehearsal's rows by their settings (--dry-run: the steps and remat parts')


def part_steps(args, say) -> dict:
    return {"rows": _step_rows(args, STEPS, say)}


def remat_rows() -> list[tuple[dict, int | None]]:
    from experiments.gpu_offload import POLICIES

    rows = [({"model": m, "precision": "bf16", "remat": r}, None) for m in ("resnet18", "vit") for r in POLICIES[m]]
    return rows + [({"model": "resnet50", "precision": "bf16", "remat": r, **RESNET50}, 256) for r in ("none", "full")]


def part_remat(args, say) -> dict:
    return {"rows": _step_rows(args, remat_rows(), say)}


def predict(gpu: str, out: Path, say) -> None:
    """The estimate's predictions for one GPU of kind ``gpu``, for every row the check measures, compiled here
    (the gpu-compile extra; no GPU): docs/gpu.md writes them down before a measurement tests them."""
    from jaxtrain import gpu as jgpu

    jgpu.check_plugin()
    rows = []
    for settings, per_gpu in STEPS + remat_rows():
        settings = {**settings, **({"batch_size": per_gpu} if per_gpu else {})}
        say(f"  {settings['model']} {settings['precision']} remat {settings.get('remat', 'none')}")
        p = jgpu.plan(gpu, 1, largest_batch=False, **settings)
        e = p.estimate
        rows.append({**{k: p.settings[k] for k in ("model", "precision", "remat")}, "batch": p.call_batch,
                     "estimate_ms": e["seconds"] * 1e3, "examples_per_second": e["examples_per_second"],
                     "mfu": e["mfu"], "hfu": e["hfu"], "memory_analysis": p.memory["total"],
                     "bottleneck": e["bottleneck"]})
    atomic_write(out / f"predict-{gpu}.json", json.dumps(rows, indent=1))
    print(report.prediction_table(gpu, rows))


E2E_EPOCHS = {"lenet": 10, "resnet18": 10}  # d2l's LeNet recipe; ResNet-18's own recipe (d2l trains it 10 too)
E2E_CONFIGS = "1:off,auto:on"  # today's path, then steps per call and the data on the device


def fashion_mnist_dir() -> list[str]:
    """``--data-dir`` for the runs: the bundle's copy of the Debian files where it is (a GPU machine has no
    Debian dataset package), else the runs' default."""
    bundled = Path(".gpu-bundle") / "fashion-mnist"
    return ["--data-dir", str(bundled)] if bundled.is_dir() else []


def part_e2e(args, say) -> dict:
    """LeNet's step per K, then each model end to end per config: ``experiments.bench_busy``, in children."""
    # A rehearsal on a CPU: tiny batches, few calls, small subsets. The GPU image's versions have no oneDNN, and
    # XLA:CPU's convolutions take seconds a ResNet-18 step even at batch 32; its work measurement alone runs ~40
    # steps. At the recipe's batch that measurement had been the CI run's longest part.
    dry = ["--train-subset", "64", "--test-subset", "64"] if args.dry_run else []
    small = ["--batch-size", "8", "--calls", "2"] if args.dry_run else []
    env = {**os.environ, **on_gpu(args)}
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("steps", ["steps", "--model", "lenet", *(["--ks", "1,8,auto", *small] if args.dry_run else
                                                           ["--ks", "1,8,64,auto"])])]
        runs += [(model, ["e2e", "--model", model, "--devices", "1", "--repeats", "1", "--configs", E2E_CONFIGS,
                          "--epochs", str(2 if args.dry_run else epochs), *small, "--", *fashion_mnist_dir(), *dry])
                 for model, epochs in E2E_EPOCHS.items()]
        for name, argv in runs:
            say(f"  {name}")
            path = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "experiments.bench_busy", *argv[:1], "--json", str(path), *argv[1:]]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            result[name] = ({"table": out.stdout, **json.loads(path.read_text())} if out.returncode == 0 else
                            {"error": last_line(out)[:500],
                             "stderr_tail": out.stderr[-2000:]})
    return result


BUFFERS = {"lenet": "1,8,auto", "resnet18": "1,8"}  # the models and Ks timed under each command-buffer mode


def part_buffers(args, say) -> dict:
    """Each model's step per K (``experiments.bench_busy steps``) under each JAXTRAIN_COMMAND_BUFFERS mode, a child
    each (XLA reads its flags once per process), the modes taking turns per model."""
    from jaxtrain.core.compat import COMMAND_BUFFER_FLAGS, command_buffers_said

    models = {"lenet": "1,8"} if args.dry_run else BUFFERS  # XLA:CPU's ResNet-18 convolutions: seconds a step
    small = ["--batch-size", "8", "--calls", "2"] if args.dry_run else []
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, ks in models.items():
            result[model] = {}
            for mode in COMMAND_BUFFER_FLAGS:
                say(f"  {model}, command buffers {mode}")
                path = Path(tmp) / f"{model}-{mode}.json"
                cmd = [sys.executable, "-m", "experiments.bench_busy", "steps", "--json", str(path), "--model", model,
                       "--ks", ks, *small]
                env = {**os.environ, **on_gpu(args), "JAXTRAIN_COMMAND_BUFFERS": mode}
                given = os.environ.get("XLA_FLAGS", "")
                if args.dry_run and "--xla_gpu_enable_command_buffer=" not in given:  # as setup_devices on a GPU:
                    env["XLA_FLAGS"] = " ".join([given, *COMMAND_BUFFER_FLAGS[mode]])  # the image's jaxlib parses it
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                result[model][mode] = (json.loads(path.read_text()) if out.returncode == 0 else
                                       {"error": last_line(out)[:500]})
                asked = command_buffers_said(" ".join(COMMAND_BUFFER_FLAGS[mode]))
                got = result[model][mode].get("command_buffers", asked)
                if got != asked:  # $XLA_FLAGS, JAXTRAIN_XLA_DEFAULTS or the jaxlib had it otherwise
                    result[model][mode]["error"] = (f"JAXTRAIN_COMMAND_BUFFERS={mode} did not reach XLA: its run "
                                                    f"had {got!r}, not {asked!r}")
    return result


def part_kernels(args) -> dict:
    json_path = Path(args.out) / "kernels.json"
    cmd = [sys.executable, "-m", "experiments.bench_kernels", "--devices", "1", "--json", str(json_path),
           *(["--repeats", "2", "--classes", "10"] if args.dry_run else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **on_gpu(args)})
    if out.returncode != 0:
        return {"error": last_line(out)}
    return {"table": out.stdout, **json.loads(json_path.read_text())}


@one_line_errors("gpu_check")
def main(argv=None) -> int:
    args = parser().parse_args(argv)

    def say(text):
        print(text, file=sys.stderr, flush=True)

    if args.predict:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        predict(args.predict, Path(args.out), say)
        return 0
    if args.dry_run and args.keep:
        raise ConfigError("--keep with --dry-run: a rehearsal's figures are no GPU's; keep only a GPU's report")
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    elif devices_seen()[0] != "gpu":
        raise ConfigError("no GPU here (JAX finds none): run this on a GPU machine, or --dry-run to rehearse it")
    start, out = time.perf_counter(), Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    runs = {"env": part_env, "tests": part_tests, "kernels": part_kernels,
            "steps": lambda a: part_steps(a, say), "remat": lambda a: part_remat(a, say),
            "e2e": lambda a: part_e2e(a, say), "buffers": lambda a: part_buffers(a, say)}
    left = []
    for name in args.part or PARTS:
        cached = out / "parts" / f"{name}.json"
        if cached.exists() and not args.again:
            say(f"{name}: cached in {cached} (--again to measure it anew)")
            continue
        if time.perf_counter() - start > args.budget:
            left.append(name)
            continue
        say(f"{name}...")
        part_start = time.perf_counter()
        result = {**runs[name](args), "part_seconds": time.perf_counter() - part_start, "dry_run": args.dry_run}
        atomic_write(cached, json.dumps(result, indent=1, default=str))
    parts = {p.stem: json.loads(p.read_text()) for p in sorted((out / "parts").glob("*.json"))}
    atomic_write(out / "report.json", json.dumps(parts, indent=1, default=str))
    atomic_write(out / "report.md", report.markdown(parts))
    if args.keep:  # the run's record, named by date and GPU: docs/gpu-runs/2026-11-27-h100.json
        parts = {"run": report.run_header(parts), **parts}
        name = f"{parts['run']['date']}-{parts['run']['gpu']}"
        for kept in (Path(args.keep) / f"{name}.json", Path(args.keep) / f"{name}.md"):
            kept.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(kept, json.dumps(parts, indent=1, default=str) if kept.suffix == ".json"
                         else report.markdown(parts))
        say(f"kept: {Path(args.keep) / name}.json and .md (commit them)")
    print(f"report: {out / 'report.md'} and {out / 'report.json'}"
          + (f"; not started (budget {args.budget} s spent): {', '.join(left)}: run the same command again" if left
             else ""))
    failed = (parts.get("tests", {}).get("returncode", 0) != 0 or "error" in parts.get("kernels", {})
              or any("error" in r for k in ("steps", "remat") for r in parts.get(k, {}).get("rows", []))
              or any("error" in run for run in parts.get("e2e", {}).values() if isinstance(run, dict))
              or any("error" in run for model in parts.get("buffers", {}).values() if isinstance(model, dict)
                     for run in model.values()))
    return 3 if left else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
