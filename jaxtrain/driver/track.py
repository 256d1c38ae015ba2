"""Experiment tracking (``--track wandb`` / ``--track mlflow``): a view of a run in W&B or MLflow.

It gets what TensorBoard gets (the config, ``train_step/``, ``test_step/`` and
``epoch/`` scalars: ``observe`` hands both the same values) and, at the end,
the summary and ``curves.png``. Process 0 only.

- W&B runs OFFLINE unless the user has logged in (``wandb login`` writes
  ``~/.netrc``) or set ``WANDB_API_KEY``; ``WANDB_MODE`` overrides. Its files
  go under ``OUT/wandb``; ``wandb sync OUT/wandb/offline-run-*`` uploads later.
- MLflow logs to ``sqlite:///OUT/mlflow.db`` (artifacts: ``OUT/mlartifacts``)
  unless ``MLFLOW_TRACKING_URI`` is set (``mlflow ui --backend-store-uri
  sqlite:///OUT/mlflow.db`` shows it).

A tracker is a view, not the record (metrics.jsonl and summary.json are): if
its library is missing or a call fails (full disk, no server), ONE warning
says so and the run goes on without it. A resumed run (same ``--out``)
continues the same tracked run: its id is kept in ``OUT/track.json`` (where
it is missing or unreadable, one warning says a new tracked run is opened). It
recomputes the steps after its checkpoint bit for bit, so MLflow skips a
step of a metric it already holds (its history cannot be rewritten), and
matches metrics.jsonl, which the resumed run rewrites from there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import netrc
from pathlib import Path
from urllib.parse import urlparse

from jaxtrain import settings
from jaxtrain.io.dirlock import taking_turns
from jaxtrain.io.files import atomic_write

log = logging.getLogger(__name__)


class Tracker:
    """One tracked run. Every call is guarded: the first failure warns once, later calls do nothing."""

    def __init__(self, kind: str, out_dir: Path, config: dict, group: str | None, resumed: bool = False):
        self.kind, self.out_dir, self.broken, self.resumed = kind, Path(out_dir), False, resumed
        self._prefixes: set[str] = set()
        self._guard(self._open, config, group)

    def _guard(self, fn, *args):
        if self.broken:
            return None
        try:
            return fn(*args)
        except ImportError:
            self._fail(f"{self.kind} is not installed (pip install 'jaxtrain[{self.kind}]')")
        except Exception as e:  # noqa: BLE001 - a view never stops the run
            self._fail(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        return None

    def _fail(self, why: str) -> None:
        self.broken = True
        log.warning("--track %s: off (%s); the run goes on (metrics.jsonl and summary.json "
                    "are its record)", self.kind, why)
        with contextlib.suppress(OSError, ValueError):  # for a sweep to report (it reads OUT/track.json)
            self._keep("failed", f"--track {self.kind}: {why}")

    # ------------------------------------------------------------------ the hook's interface

    def scalars(self, step: int, values: dict, prefix: str) -> None:
        """``prefix/name`` scalars at ``step`` (a step number for ``train_step``, an epoch for ``epoch``)."""
        self._guard(self._scalars, step, {f"{prefix}/{k}": float(v) for k, v in values.items()}, prefix)

    def flush(self) -> None:
        pass  # both libraries write in their own time; finish() waits for them

    def finish(self, summary: dict, files: list[Path]) -> None:
        """The run's summary (its numbers) and files (curves.png), then the run is closed as finished."""
        numbers = {k: float(v) for k, v in summary.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._guard(self._finish, numbers, [f for f in files if f.is_file()])
        self.broken = True  # closed

    def close(self, status: str = "failed") -> None:
        """Close a run that did not finish (``failed`` or ``killed``); nothing if finished or broken."""
        self._guard(self._close, status)
        self.broken = True

    # ------------------------------------------------------------------ kept ids

    def _kept_id(self) -> str | None:
        """The id of the tracked run this ``--out`` logged to; None (said in one line if this run resumes) opens a
        new one."""
        path = self.out_dir / "track.json"
        try:
            kept = json.loads(path.read_text())
            run_id = kept.get(self.kind) if isinstance(kept, dict) else None
            why = None if run_id else f"holds no {self.kind} run"
        except FileNotFoundError:
            run_id, why = None, "is missing"
        except (OSError, ValueError) as e:
            run_id, why = None, f"cannot be read ({type(e).__name__}: {str(e)[:100]})"
        if why and self.resumed:
            log.warning("--track %s: %s %s: this resumed run is logged to a new %s run (its earlier steps are in "
                        "metrics.jsonl)", self.kind, path, why, self.kind)
        return run_id

    def _keep_id(self, run_id: str) -> None:
        self._keep(self.kind, run_id)

    def _keep(self, key: str, value: str) -> None:
        path = self.out_dir / "track.json"
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            kept = {}
        atomic_write(path, json.dumps({**kept, key: value}, indent=2) + "\n")


class WandbTracker(Tracker):
    def _open(self, config, group):
        import wandb

        self.run = wandb.init(project=settings.tracker("WANDB_PROJECT", "jaxtrain"), group=group,
                              name=self.out_dir.name, dir=str(self.out_dir), config=config, mode=wandb_mode(),
                              id=self._kept_id(), resume="allow",
                              settings=wandb.Settings(console="off", silent=True))
        self._keep_id(self.run.id)

    def _scalars(self, step, values, prefix):
        if prefix not in self._prefixes:  # each prefix counts its own step (steps vs epochs)
            self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
            self._prefixes.add(prefix)
        self.run.log({f"{prefix}/step": step, **values})

    def _finish(self, numbers, files):
        import wandb

        self.run.summary.update(numbers)
        for f in files:
            self.run.log({f"files/{f.stem}": wandb.Image(str(f))})
        self.run.finish()

    def _close(self, status):
        self.run.finish(exit_code=1 if status == "failed" else 130)


class MlflowTracker(Tracker):
    def _open(self, config, group):
        uri = settings.tracker("MLFLOW_TRACKING_URI") or f"sqlite:///{(self.out_dir / 'mlflow.db').resolve()}"
        self.client, experiment = mlflow_experiment(uri, group or settings.tracker("MLFLOW_EXPERIMENT_NAME")
                                                    or "jaxtrain")
        run_id, self._held = self._kept_id(), {}
        if run_id is None:
            run_id = self.client.create_run(experiment, run_name=self.out_dir.name,
                                            tags={"out": str(self.out_dir.resolve())}).info.run_id
            self._keep_id(run_id)
            params = {k: str(v)[:500] for k, v in sorted(config.items())}  # MLflow keeps <= 500 characters
            items = list(params.items())
            for i in range(0, len(items), 100):  # <= 100 params a batch
                self.client.log_batch(run_id, params=[_param(k, v) for k, v in items[i:i + 100]])
            self.client.log_dict(run_id, config, "config.json")
        else:
            self.client.update_run(run_id, status="RUNNING")
            held = self.client.get_run(run_id).data.metrics  # {metric: its latest value}: the metrics' names
            self._held = {k: {m.step for m in self.client.get_metric_history(run_id, k)} for k in held}
        self.run_id = run_id

    def _scalars(self, step, values, prefix):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        new = [Metric(k, v, now, step) for k, v in values.items() if step not in self._held.get(k, ())]
        if new:
            self.client.log_batch(self.run_id, metrics=new)

    def _finish(self, numbers, files):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"summary/{k}", v, now, 0) for k, v in numbers.items()])
        for f in files:
            self.client.log_artifact(self.run_id, str(f))
        self.client.set_terminated(self.run_id, "FINISHED")

    def _close(self, status):
        self.client.set_terminated(self.run_id, "KILLED" if status == "killed" else "FAILED")


def mlflow_experiment(uri: str, name: str):
    """A client of MLflow's store at ``uri`` and the id of its experiment ``name``, both made if need be: one
    process at a time for a SQLite store (a sweep makes them before its trials start; runs started at once take
    turns); a server's experiment made meanwhile by another process is taken.

    A SQLite store keeps its artifacts beside it (MLflow's default is ./mlruns, wherever the run started). An
    HTTP server gets a bounded wait: ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` 2 and ``MLFLOW_HTTP_REQUEST_TIMEOUT``
    10 s unless set (MLflow's own defaults wait about 4 minutes for a server that is not there), and a line
    says what it waits for."""
    import logging

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its INFO lines about making tables (after its import)

    if uri.startswith(("http://", "https://")):
        for var, value in HTTP_WAIT.items():
            settings.default_tracker(var, value)
        log.info(f"--track mlflow: connecting to {uri} (up to {_http_wait_sec()} s if it does not answer)")
    sqlite = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    with taking_turns(sqlite) if sqlite else contextlib.nullcontext():  # the client's first use makes its tables
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(name)
        if found:
            return client, found.experiment_id
        beside = (sqlite.parent / "mlartifacts").resolve().as_uri() if sqlite else None
        try:
            return client, client.create_experiment(name, artifact_location=beside)
        except MlflowException:
            found = client.get_experiment_by_name(name)  # made meanwhile by another process (a server's store)
            if found is None:
                raise
            return client, found.experiment_id


HTTP_WAIT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _http_wait_sec() -> int:
    """About how long MLflow waits for a server that does not answer (its retries back off by a factor)."""
    retries = int(settings.tracker("MLFLOW_HTTP_REQUEST_MAX_RETRIES"))
    timeout = int(settings.tracker("MLFLOW_HTTP_REQUEST_TIMEOUT"))
    backoff = int(settings.tracker("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "2"))
    return (retries + 1) * timeout + sum(backoff * 2**i for i in range(retries))


def _param(key, value):
    from mlflow.entities import Param

    return Param(key, value)


def wandb_mode() -> str:
    """``WANDB_MODE`` if set; else online when logged in (``WANDB_API_KEY``, or ``wandb login``'s ~/.netrc entry
    for the W&B host), offline otherwise."""
    if settings.tracker("WANDB_MODE"):
        return settings.tracker("WANDB_MODE")
    if settings.tracker("WANDB_API_KEY"):
        return "online"
    host = urlparse(settings.tracker("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc(settings.tracker("NETRC")).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def start(kind: str, out_dir: Path, config: dict, group: str | None = None, resumed: bool = False) -> Tracker | None:
    """The tracker ``--track`` names (``none``: None); ``resumed``: the run goes on from a checkpoint (its tracked
    run, kept in ``out_dir``, goes on)."""
    return None if kind == "none" else TRACKERS[kind](kind, out_dir, config, group, resumed)
