"""A run's files: its directory (claimed, locked), metrics.jsonl, summary.json and curves.png, each written whole
or not at all."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path

from jaxtrain.errors import ConfigError, missing, named
from jaxtrain.io.dirlock import DirLock
from jaxtrain.io.files import atomic_write, ensure_room, ensure_writable, out_of_space, remove_stale_temps

log = logging.getLogger(__name__)


def make_out_dir(out: str | None, name: str) -> Path:
    """``out``, or a fresh ``runs/NAME-YYYYmmdd-HHMMSS[-k]``; checked writable now."""
    if out is None:
        base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path, k = base, 1
        while path.exists():
            path, k = Path(f"{base}-{k}"), k + 1
    else:
        path = Path(out)
    return ensure_writable(path, "to output directory", named("out"))


def holds_results(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a run's results (a summary, a model, or epochs in metrics.jsonl)."""
    metrics = out_dir / "metrics.jsonl"
    return finished(out_dir) or (metrics.is_file() and metrics.stat().st_size > 0)


def finished(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a finished run's results (its summary, or its model)."""
    return any((out_dir / name).exists() for name in ("summary.json", "model.json"))


def claim_out_dir(out: str | None, name: str, resumed: bool, found_none: str | None = None) -> tuple[Path, DirLock]:
    """The run directory (``out``, or a fresh one), this run's alone (locked: two runs never write one) and
    with room for its files; another run's results there are kept unless the run resumes from a checkpoint.
    ``found_none``: the checkpoint directory where a resume found none: a finished run's results are refused,
    an unfinished start's epochs (its first checkpoint never saved) kept aside as it starts again."""
    out_dir = make_out_dir(out, name)
    if not resumed and found_none is not None and finished(out_dir):
        raise ConfigError(f"{named('out', out_dir)} holds a finished run's results, and {named('resume', True)} found "
                          f"no checkpoint in {found_none} to continue it from: give the {named('checkpoint_dir')} "
                          f"that run saved to, or a new {named('out')} to start afresh")
    earlier = not resumed and found_none is not None and holds_results(out_dir)
    if not resumed and not earlier and holds_results(out_dir):
        raise ConfigError(f"{named('out', out_dir)} holds another run's results: pass a new {named('out')} (or, "
                          f"where that run saved checkpoints, continue it with {named('resume', True)} and its "
                          f"{named('checkpoint_dir')})")
    lock = DirLock(out_dir, named("out")).acquire()
    try:
        ensure_room(out_dir, 2**20, "metrics, summary and curves", named("out"))
        if earlier:  # ours now (locked): kept before this run writes its own
            kept = keep_copy(out_dir / "metrics.jsonl", "earlier")
            log.warning(f"{out_dir / 'metrics.jsonl'} holds epochs of a start that saved no checkpoint: kept as "
                        f"{kept.name}; this run starts again from scratch")
    except BaseException:
        lock.release()
        raise
    return out_dir, lock


def keep_copy(path: Path, kind: str) -> Path:
    """A copy of ``path`` beside it (``NAME.KIND-TIME``) before it is written anew; a one-line OutputError where
    it cannot be made (the file is then left as it is)."""
    kept = path.with_name(f"{path.name}.{kind}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        shutil.copyfile(path, kept)
    except OSError as e:
        raise OutputError(f"cannot keep {path} as {kept.name} ({_cause(e)}): make room, then run again") from None
    return kept


def _cause(e: OSError) -> str:
    return "the disk is full" if out_of_space(e) else e.strerror or str(e)


class OutputError(ConfigError):
    """A run file could not be written (full disk, vanished directory)."""


def strict_json(data, **kw) -> str:
    """JSON any parser reads: a NaN or infinite number (e.g. an epoch not evaluated) is written as null."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return [clean(v) for v in x] if isinstance(x, (list, tuple)) else x

    return json.dumps(clean(data), allow_nan=False, **kw)


def write_whole(path: Path, data) -> None:
    """``path`` written whole or not at all; a one-line OutputError says why not."""
    try:
        atomic_write(path, data)
    except OSError as e:
        raise OutputError(f"cannot write {path} ({_cause(e)}); its previous version, if any, is intact: "
                          f"make room (or fix {named('out')}), then run again (with {named('resume', True)} if you "
                          "checkpoint)") from None


def write_summary(out_dir: Path, summary: dict) -> Path:
    """summary.json: the run's summary, sorted, strict JSON."""
    path = out_dir / "summary.json"
    write_whole(path, strict_json(summary, indent=2, sort_keys=True) + "\n")
    return path


class RunWriter:
    """Writes one run's files into ``out_dir`` as the run goes; each file whole or not at all.

    ``history`` (rows of earlier epochs, e.g. from a checkpoint) is written
    again at once; a run's files are never truncated. In a SLURM job each epoch's row says which start of the
    job ran it (``job``: its id and restart count), and a stop on a signal is a row of its own (``stopped``);
    a resumed run keeps the rows of its earlier starts that its checkpoint holds.
    """

    def __init__(self, out_dir: Path, history: list[dict] = (), job: dict | None = None, resumed: bool = False):
        self.out_dir = out_dir
        self.metrics_path = out_dir / "metrics.jsonl"
        remove_stale_temps(out_dir)
        self.job = job and {"id": job["job_id"], "restart_count": job["restart_count"]}
        self.rows: list[dict] = self._carried(history) if resumed else [dict(h) for h in history]
        self.no_plot, self._told = missing("matplotlib", "curves.png"), False  # said once, at the first epoch's end
        write_whole(self.metrics_path, self._metrics_text())

    @property
    def epochs(self) -> list[dict]:
        return [row for row in self.rows if "event" not in row]

    @property
    def stops(self) -> list[dict]:
        """The signals that stopped earlier starts of this run (and what was done: requeued or not)."""
        return [row for row in self.rows if row.get("event") == "stopped"]

    def _carried(self, history) -> list[dict]:
        """The file's rows in order: its stops, and its epochs the checkpoint holds (the checkpoint's numbers,
        the file's ``job``), then the checkpoint's epochs the file lacks."""
        held = {h["epoch"]: dict(h) for h in history}
        rows = []
        for row in _rows(self.metrics_path):
            if "event" in row:
                rows.append(row)
            elif (epoch := held.pop(row.get("epoch"), None)) is not None:
                rows.append({**epoch, **({"job": row["job"]} if "job" in row else {})})
        return rows + list(held.values())

    def _metrics_text(self) -> str:
        return "".join(strict_json(row) + "\n" for row in self.rows)

    def epoch(self, stats) -> None:
        """metrics.jsonl with this epoch's row, and curves.png redrawn (a long run can be watched)."""
        self.rows.append({**dataclasses.asdict(stats), **({"job": self.job} if self.job else {})})
        write_whole(self.metrics_path, self._metrics_text())
        self.plot()

    def stopped(self, step: int, signal: str, saved: bool, requeue: str | None) -> None:
        """metrics.jsonl with a row saying a signal stopped the run at ``step``, and what was done."""
        self.rows.append({"event": "stopped", "step": step, "signal": signal, "checkpoint_saved": saved,
                          **({"job": self.job} if self.job else {}), **({"requeue": requeue} if requeue else {})})
        write_whole(self.metrics_path, self._metrics_text())

    def summary(self, summary: dict) -> Path:
        path = write_summary(self.out_dir, summary)
        self.plot()
        return path

    def plot(self) -> Path | None:
        if not self.epochs:
            return None
        if self.no_plot:
            if not self._told:
                log.warning(self.no_plot)
                self._told = True
            return None
        path = self.out_dir / "curves.png"
        write_whole(path, curves_png(self.epochs))
        return path


def curves_png(epochs: list[dict]) -> bytes:
    """The loss and accuracy curves of ``epochs`` (metrics.jsonl's rows) as a PNG. Drawn on a Figure of its own,
    not through pyplot: a notebook's backend and figures are left as they were."""
    import io

    from matplotlib.figure import Figure

    ep = [r["epoch"] for r in epochs]
    fig = Figure(figsize=(9, 3.5))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(ep, [r["train_loss"] for r in epochs], "o-", label="train loss")
    ax1.plot(ep, [r["test_loss"] for r in epochs], "s--", label="test loss")
    ax2.plot(ep, [r["train_acc"] for r in epochs], "o-", label="train acc")
    ax2.plot(ep, [r["test_acc"] for r in epochs], "s--", label="test acc")
    for ax, title in ((ax1, "loss"), (ax2, "accuracy")):
        ax.set_xlabel("epoch")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=100, format="png")
    return png.getvalue()


def _rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows ([] where it is missing: a resumed run then writes it whole). A file with lines that
    do not read (edited, or damaged on disk) is kept beside it (``metrics.jsonl.damaged-TIME``), said in one
    warning line; its rows that read are carried on."""
    try:
        lines = path.read_bytes().decode(errors="replace").splitlines()
    except OSError:
        return []  # missing, or not a file (writing it says why)
    rows, bad = [], []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows += [row] if row else []
        else:
            bad.append(str(number))
    if bad:
        kept = keep_copy(path, "damaged")
        log.warning(f"{path}: line{'s' * (len(bad) > 1)} {', '.join(bad[:5])}{' ...' * (len(bad) > 5)} do not read: "
                    f"the file is kept as {kept.name}; its rows that read are carried on")
    return rows
