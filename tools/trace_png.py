"""Draw jax.profiler traces as a timeline PNG (a picture for the docs; open the trace itself in XProf or Perfetto).

    python tools/trace_png.py starved=/tmp/pp/starved fed=/tmp/pp/fed --out docs/trace.png

Each LABEL=DIR is a directory holding a trace (``perfetto_trace.json.gz`` below it,
as ``--profile`` writes it). One panel per trace: the Python thread's named scopes
(data_wait, train_step, eval) and the busiest XLA threads' ops, over the span of
the named scopes.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

SCOPES = {"data_wait": "tab:red", "train_step": "tab:blue", "eval": "tab:green"}


def load(directory: Path):
    """(lanes: {name: [(start_ms, dur_ms, event name)]}, span (t0, t1) in ms) of the newest trace under it."""
    files = sorted(directory.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"trace_png: error: no perfetto_trace.json.gz under {directory} (run with --profile)")
    events = json.load(gzip.open(files[-1]))["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    scoped = [e for e in spans if e["name"] in SCOPES]
    if not scoped:
        raise SystemExit(f"trace_png: error: {files[-1]} holds none of the loop's named scopes {', '.join(SCOPES)}")
    t0 = min(e["ts"] for e in scoped)
    t1 = max(e["ts"] + e.get("dur", 0) for e in scoped)
    busy = collections.Counter()
    for e in spans:
        if t0 <= e["ts"] <= t1:
            busy[(e["pid"], e["tid"])] += e.get("dur", 0)
    main = (scoped[0]["pid"], scoped[0]["tid"])
    ranked = [k for k, _ in busy.most_common() if k != main]
    xla = [k for k in ranked if "XLA" in threads.get(k, "")][:2]  # the device's threads, then the busiest other
    chosen = [main, *xla, *[k for k in ranked if k not in xla][:1]]
    lanes = {}
    for key in chosen:
        name = "python (loop)" if key == main else threads.get(key, str(key[1])).split("/")[0].replace("tf_", "")
        name = "python (loader thread)" if name == "python" else name
        lanes[f"{name} #{len(lanes)}" if name in lanes else name] = [
            ((e["ts"] - t0) / 1e3, e.get("dur", 0) / 1e3, e["name"]) for e in spans
            if (e["pid"], e["tid"]) == key and t0 <= e["ts"] <= t1 and (key != main or e["name"] in SCOPES)]
    return lanes, (t1 - t0) / 1e3


def draw(traces: dict[str, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 2.2 * len(traces)), squeeze=False)
    for ax, (label, directory) in zip(axes[:, 0], traces.items()):
        lanes, span = load(directory)
        for row, (lane, boxes) in enumerate(lanes.items()):
            colors = [SCOPES.get(name, "0.55") for _, _, name in boxes]
            ax.broken_barh([(s, d) for s, d, _ in boxes], (row - 0.4, 0.8), facecolors=colors, linewidth=0)
        ax.set_yticks(range(len(lanes)), list(lanes))
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        ax.set_title(f"{label}: {span:.0f} ms traced", loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms")
    handles = [Patch(color=c, label=n) for n, c in SCOPES.items()] + [Patch(color="0.55", label="XLA ops")]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", metavar="LABEL=DIR")
    p.add_argument("--out", type=Path, default=Path("trace.png"))
    args = p.parse_args(argv)
    if any("=" not in t for t in args.traces):
        p.error("each trace is LABEL=DIR")
    draw({k: Path(v) for k, v in (t.split("=", 1) for t in args.traces)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
