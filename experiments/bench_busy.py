"""Keeping the device busy, measured: steps per call and the data on the device, the step alone and end to end.

    python -m experiments.bench_busy steps [--model lenet] [--ks 1,8,64,auto] [--devices 1]
    python -m experiments.bench_busy e2e [--model lenet] [--epochs 3] [--configs 1:off,8:off,8:on] [--repeats 2]

``steps``: the step's time per step in calls of K steps (K = 1, 8, 64, and ``auto`` as the run would pick it;
``--repeats`` blocks (1 unless given) of ``--calls`` calls each, the Ks interleaved, median), against the device's
work alone: what one more step adds to a call (``jaxtrain.driver.busy.per_step_in_call``: the host's part, paid once
a call, cancels out). ``e2e``: the experiment itself (``python -m experiments.MODEL``, Fashion-MNIST) once per
config ``K:DATA`` (``--steps-per-call K --data-on-device DATA``), configs interleaved ``--repeats`` times (2 unless
given): seconds per epoch (epochs after the first, which compiles; median), beside the first config's, the test
accuracy, the data wait, and the device's busy share: steps x the device's work per step (``steps``, measured first
in its own process) over the epoch's wall time. Each run is a child process (a GPU is held by one process at a
time). Extra flags after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import harness
from jaxtrain.cli import one_line_errors, positive_int
from jaxtrain.errors import ConfigError


def steps_list(text: str) -> list[str]:
    """``--ks``: whole numbers >= 1 or ``auto``, comma-separated."""
    ks = text.split(",")
    if not all(k == "auto" or k.isdigit() and int(k) >= 1 for k in ks):
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers >= 1 or auto, comma-separated (1,8,auto)")
    return ks


def configs_list(text: str) -> list[str]:
    """``--configs``: K:DATA, comma-separated; K a whole number >= 1 or auto, DATA on, off or auto."""
    configs = text.split(",")
    for config in configs:
        k, _, data = config.partition(":")
        if not (k == "auto" or k.isdigit() and int(k) >= 1) or data not in ("on", "off", "auto"):
            raise argparse.ArgumentTypeError(f"{config!r}: expected K:DATA, K a whole number >= 1 or auto, DATA "
                                             "on, off or auto (1:off,8:on)")
    return configs


REPEATS = {"steps": 1, "e2e": 2}  # --repeats unless given: steps' timed blocks (the Ks taking turns), e2e's runs


def parser() -> argparse.ArgumentParser:
    p = harness.parser("bench_busy", __doc__, steps=None, repeats=None)  # --repeats: by mode (REPEATS)
    p.formatter_class, p.epilog = argparse.RawDescriptionHelpFormatter, __doc__.split("\n", 2)[2]
    p.add_argument("what", choices=("steps", "e2e"),
                   help="the step alone, or the experiment end to end (e2e: the flags after -- go to every run)")
    p.add_argument("--model", default="lenet", choices=("lenet", "resnet18"))
    p.add_argument("--devices", type=positive_int, default=None, help="devices (None: all)")
    p.add_argument("--ks", type=steps_list, default="1,8,64,auto",
                   help="steps: the calls' steps to time, comma-separated")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="the global batch (None: the recipe's); e2e: the runs' and their work measurement's")
    p.add_argument("--conv", default="auto", choices=("auto", "onednn", "xla"),
                   help="steps: whose convolutions (auto: oneDNN's on a CPU where they build)")
    p.add_argument("--unroll", default="off", choices=("auto", "on", "off"),
                   help="steps: a call's steps in a loop (off: the runs'), laid out straight (on: "
                        "trainer.steps(..., unroll=True)), or auto (unroll=None: straight where compiled for a CPU)")
    p.add_argument("--calls", type=positive_int, default=20,
                   help="steps: calls per timed block (e2e: its work measurement's)")
    p.add_argument("--epochs", type=positive_int, default=3, help="e2e: epochs per run (the first is not timed)")
    p.add_argument("--configs", type=configs_list, default="1:off,8:off,8:on",
                   help="e2e: K:DATA per run, comma-separated (the first is the baseline)")
    return p


@dataclasses.dataclass
class Calls(harness.Timed):
    """Calls of ``k`` steps (``step``: the trainer's step, or its call of ``k`` steps on ``k`` batches), one in
    flight: each call's result awaited before the next, the host's part of a call not hidden. Per step, as Timed."""

    k: int = 1

    def time(self, calls: int) -> float:
        import jax

        start = time.perf_counter()
        for _ in range(calls):
            self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / (calls * self.k)


def step_times(model_name: str, devices: int | None, ks: list[str], batch_size: int | None, calls: int,
               conv: str = "auto", unroll: str = "off", repeats: int = 1) -> dict:
    """Seconds per step in calls of each K (``repeats`` blocks of ``calls`` calls, the Ks interleaved), and the
    device's work per step (``per_step_in_call``)."""
    import jax
    import optax

    import jaxtrain as jt
    from jaxtrain import models, settings
    from jaxtrain.core.compat import command_buffers_said
    from jaxtrain.driver import busy

    mesh = jt.make_mesh(jt.setup_devices(devices))
    platform = mesh.devices.flat[0].platform
    model = models.get(model_name, conv=conv)
    batch_size = batch_size or models.MODELS[model_name].batch_size
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.01), mesh=mesh)
    batch = model.example_batch(batch_size)
    work = busy.per_step_in_call(trainer, trainer.init(*jax.jit(model.init)(jax.random.key(0))), batch)

    def calls_of(n: int) -> Calls:  # its own state: the calls donate it
        state = trainer.init(*jax.jit(model.init)(jax.random.key(0)))
        if n == 1:
            return Calls(trainer.step, state, trainer.shard(batch))
        stacked = trainer.shard_steps(jax.tree.map(lambda x: x[None].repeat(n, 0), batch))
        return Calls(functools.partial(trainer.placed_steps, unroll=harness.UNROLL[unroll]), state, stacked, k=n)

    runs = [calls_of(busy.steps_per_call("auto", platform, lambda: work)[0] if k == "auto" else int(k)) for k in ks]
    for run in runs:
        harness.warm_up(run)  # compiled, warm
    harness.interleave(runs, calls, repeats)
    rows = [{"k": k, "steps_per_call": run.k, "ms_per_step": run.median, "over_work": run.median / 1e3 / work}
            for k, run in zip(ks, runs)]
    return {"model": model_name, "conv": conv, "devices": mesh.devices.size, "batch_size": batch_size,
            "platform": platform, "command_buffers": command_buffers_said(settings.xla_flags()),
            "device_kind": mesh.devices.flat[0].device_kind, "work_ms_per_step": 1e3 * work, "rows": rows}


def steps_table(result: dict) -> str:
    lines = [f"{result['model']} ({result['conv']} convolutions), batch {result['batch_size']} on "
             f"{result['devices']} {result['platform']} "
             f"device(s) ({result['device_kind']}): the device's work {result['work_ms_per_step']:.3f} ms a step",
             f"{'K':>6} {'steps/call':>10} {'ms/step':>9} {'x work':>7}"]
    lines += [f"{r['k']:>6} {r['steps_per_call']:>10} {r['ms_per_step']:>9.3f} {r['over_work']:>7.2f}"
              for r in result["rows"]]
    return "\n".join(lines)


def _child(args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        raise ConfigError(f"{' '.join(args[:3])} failed: {last}")
    return out


def end_to_end(model: str, devices: int | None, epochs: int, configs: list[str], repeats: int,
               extra: list[str], batch_size: int | None = None, calls: int = 20) -> dict:
    """Each config's runs (interleaved), and the device's work per step measured first in a child process, at the
    runs' batch (``batch_size``, default the recipe's) over ``calls`` calls."""
    if epochs < 2:
        raise ConfigError("--epochs must be at least 2: the first epoch compiles and is not timed")
    parsed = [tuple(config.split(":")) for config in configs]
    with tempfile.TemporaryDirectory() as tmp:
        work_json = Path(tmp) / "work.json"
        batch = ["--batch-size", str(batch_size)] if batch_size else []
        devices_flag = ["--devices", str(devices)] if devices else []
        _child(["-m", "experiments.bench_busy", "steps", "--model", model, "--ks", "1", "--calls", str(calls),
                "--repeats", "1", *batch, *devices_flag, "--json", str(work_json)])
        work_ms = json.loads(work_json.read_text())["work_ms_per_step"]
        runs = {config: [] for config in configs}
        for repeat in range(repeats):
            for config, (k, data) in zip(configs, parsed):
                out = Path(tmp) / f"{len(runs[config])}-{config.replace(':', '-')}"
                harness.progress(f"run {repeat + 1}/{repeats}: {config}")
                _child(["-m", f"experiments.{model}", "--epochs", str(epochs), "--steps-per-call", k,
                        "--data-on-device", data, "--no-progress", "--out", str(out),
                        *batch, *devices_flag, *extra])
                epochs_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                summary = json.loads((out / "summary.json").read_text())
                runs[config].append({"epochs": epochs_rows, "summary": summary})
    rows = []
    for config in configs:
        timed = [e for run in runs[config] for e in run["epochs"][1:] if "train_sec" in e]
        sec = statistics.median(e["train_sec"] for e in timed)
        steps = timed[0]["steps"]
        rows.append({"config": config, "sec_per_epoch": sec, "steps_per_epoch": steps,
                     "test_acc": statistics.median(r["summary"]["test_acc"] for r in runs[config]),
                     "data_wait_fraction": statistics.median(e["data_wait_fraction"] for e in timed),
                     "busy_share": steps * work_ms / 1e3 / sec,
                     "params_digest": sorted({r["summary"]["params_digest"] for r in runs[config]})})
    for row in rows:
        row["vs_first"] = row["sec_per_epoch"] / rows[0]["sec_per_epoch"]
    return {"model": model, "devices": devices, "epochs": epochs, "batch_size": batch_size, "extra": extra,
            "work_ms_per_step": work_ms,
            "rows": rows}


def e2e_table(result: dict) -> str:
    lines = [f"{result['model']}, {result['epochs']} epochs ({' '.join(result['extra']) or 'the recipe'}); the "
             f"device's work {result['work_ms_per_step']:.3f} ms a step",
             f"{'K:data':>10} {'s/epoch':>8} {'vs first':>8} {'test acc':>8} {'data wait':>9} {'busy':>6}"]
    lines += [f"{r['config']:>10} {r['sec_per_epoch']:>8.2f} {r['vs_first']:>8.3f} {r['test_acc']:>8.3f} "
              f"{100 * r['data_wait_fraction']:>8.1f}% {100 * r['busy_share']:>5.0f}%" for r in result["rows"]]
    return "\n".join(lines)


@one_line_errors("bench_busy")
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser().parse_args(argv[:cut]), argv[cut + 1:]  # e2e: the runs' own flags after --
    args.repeats = args.repeats or REPEATS[args.what]
    if args.what == "steps":
        result = step_times(args.model, args.devices, args.ks, args.batch_size, args.calls, args.conv, args.unroll,
                            args.repeats)
        print(steps_table(result))
    else:
        result = end_to_end(args.model, args.devices, args.epochs, args.configs, args.repeats, extra,
                            args.batch_size, args.calls)
        print(e2e_table(result))
    harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
