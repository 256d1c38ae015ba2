"""Run outputs: metrics.jsonl, summary.json, the curves PNG, params digest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxtrain.errors import ConfigError


def params_digest(params) -> str:
    """sha256 of the params' bytes, leaves in tree order (dict keys sorted)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def make_out_dir(out: str | None, name: str) -> Path:
    """``out``, or a fresh ``runs/NAME-YYYYmmdd-HHMMSS[-k]``; checked writable now."""
    if out is None:
        base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path, k = base, 1
        while path.exists():
            path, k = Path(f"{base}-{k}"), k + 1
    else:
        path = Path(out)
    return ensure_writable(path, "to output directory", "--out DIR")


def ensure_writable(path: Path, what: str, flag: str) -> Path:
    """Create ``path`` and prove it writable now, not after an hour of training."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{jax.process_index()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write {what} {path} ({e.strerror}); pass {flag} somewhere writable") from None
    return path


class RunWriter:
    """Writes one run's files into ``out_dir`` as the run goes."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.metrics_path = out_dir / "metrics.jsonl"
        self.metrics_path.write_text("")  # a fresh run starts a fresh log
        self.epochs: list[dict] = []

    def epoch(self, stats) -> None:
        row = dataclasses.asdict(stats)
        self.epochs.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def summary(self, summary: dict) -> Path:
        path = self.out_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        self.plot()
        return path

    def plot(self) -> Path | None:
        if not self.epochs:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ep = [r["epoch"] for r in self.epochs]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
        ax1.plot(ep, [r["train_loss"] for r in self.epochs], "o-", label="train loss")
        ax1.plot(ep, [r["test_loss"] for r in self.epochs], "s--", label="test loss")
        ax2.plot(ep, [r["train_acc"] for r in self.epochs], "o-", label="train acc")
        ax2.plot(ep, [r["test_acc"] for r in self.epochs], "s--", label="test acc")
        for ax, title in ((ax1, "loss"), (ax2, "accuracy")):
            ax.set_xlabel("epoch")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = self.out_dir / "curves.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
