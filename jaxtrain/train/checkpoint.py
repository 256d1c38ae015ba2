"""Orbax checkpoints of the TrainState and the data position, with exact, verified resume.

A checkpoint (one orbax step, numbered by train steps) holds three items:
``state`` (the TrainState: params, optimizer state, model state, loss scale,
RNG), ``position`` (the loop's ``Position`` as JSON) and ``record`` (JSON:
the run's settings, the state's layout, and digests of the state and the
position taken at save time). Saving is asynchronous; the newest ``keep``
checkpoints are kept; one run at a time owns the directory (a lock).

Restoring reads the newest checkpoint's record first: settings that change
what the state means, or a different layout, are a ``ConfigError`` (never
"corruption"). A checkpoint whose digests do not match what was read, or
that fails with a known read error (a file missing, truncated or not
decodable), is moved aside into ``DIR/unreadable/`` (not deleted), with a
warning, and the previous one is tried; moving it lets new saves at those
step numbers land. Any other error (a changed dependency, a bug) moves
nothing and stops with a ConfigError, and so does a directory whose every
checkpoint was damaged: a resume never silently starts from scratch. A state
whose parameters are not finite is never saved (``Diverged``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import jax

from jaxtrain.core.state import TrainState
from jaxtrain.errors import ConfigError, named
from jaxtrain.io.dirlock import DirLock
from jaxtrain.io.files import atomic_write, drop_late_read_reports, ensure_room, ensure_writable, out_of_space
from jaxtrain.train import integrity
from jaxtrain.train.loop import Position, check_finite

log = logging.getLogger(__name__)

UNREADABLE = "unreadable"
EVALUATED = "evaluated"  # a checkpoint's position once its evaluation came after it was saved (``STEP.json``)
# What orbax and tensorstore say when a checkpoint's bytes are damaged (seen with files truncated, zeroed,
# deleted, or JSON overwritten, orbax 0.11): only these mark a checkpoint corrupt.
_READ_ERRORS = ("Encountered error while reading", "was not found in the checkpoint", "DATA_LOSS", "NOT_FOUND",
                "OUT_OF_RANGE", "Error reading", "Error opening")


def _damaged(e: Exception) -> bool:
    """Whether ``e``, raised while restoring, means damaged files (not a bug or a changed dependency)."""
    if isinstance(e, (OSError, json.JSONDecodeError, UnicodeDecodeError)):
        return True
    return any(marker in str(e) for marker in _READ_ERRORS)


def _saveable(state: TrainState) -> TrainState:
    """Typed PRNG keys are stored as their uint32 data."""
    return state.replace(rng=jax.random.key_data(state.rng))


def _abstract(state: TrainState):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _saveable(state))


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _quiet_orbax_errors() -> None:
    """A failed background save reaches us as an exception, which becomes one line (``_SaveErrors``).

    orbax also logs it with tracebacks (its ERROR records are dropped), and
    tensorstore writes still in flight then call back into orbax's closed
    event loop and report "RuntimeError: Event loop is closed" as
    unraisable, and asyncio logs the failed write once more when its future
    is collected: those are dropped too.
    """
    import logging

    logger = logging.getLogger("absl")
    if any(getattr(f, "jaxtrain", False) for f in logger.filters):
        return

    def drop(record):
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)

    drop.jaxtrain = True
    logger.addFilter(drop)
    logging.getLogger("asyncio").addFilter(  # the same failure, found again when its future is collected
        lambda r: not (r.exc_info and r.exc_info[1] is not None and out_of_space(r.exc_info[1])))
    drop_late_read_reports()


@dataclasses.dataclass
class Restored:
    state: TrainState
    position: Position
    step: int
    settings: dict  # the settings the checkpoint was written with


class Checkpointer:
    """Save and restore ``(TrainState, Position)`` in ``directory`` with orbax.

    ``settings`` (JSON-able) are recorded in every checkpoint; on restore,
    the keys in ``fixed`` must match them.
    """

    def __init__(self, directory: str | Path, keep: int = 3, settings: Mapping | None = None,
                 fixed: tuple[str, ...] = (), param: str | None = None):
        import orbax.checkpoint as ocp

        param = named("checkpoint_dir") if param is None else param
        if keep < 1:
            raise ConfigError(f"keep={keep}: must be >= 1")
        self.directory = ensure_writable(Path(directory).absolute(), "checkpoints to", param)
        self.param, self.settings, self.fixed, self.keep = param, dict(settings or {}), fixed, keep
        self._lock = DirLock(self.directory, param).acquire() if jax.process_index() == 0 else None
        self._ocp = ocp
        _quiet_orbax_errors()
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True))
        self._saving: int | None = None
        self._closed = False

    def save(self, state: TrainState, position: Position, wait: bool = False) -> None:
        """Save at step ``position.total_steps`` (asynchronously unless ``wait``)."""
        ocp = self._ocp
        step = position.total_steps
        check_finite(state.params, step)  # an update overflowed: never saved as a good state
        pos = dataclasses.asdict(position)
        with self._io(step):
            if step in self.manager.all_steps():  # saved before its evaluation (a stop's, at an epoch's end)
                if position.result:
                    self._evaluated_later(step, pos)
            else:
                saveable = _saveable(state)
                record = {"settings": self.settings, "layout": integrity.layout(saveable),
                          "state_digest": integrity.state_digest(saveable),
                          "position_digest": integrity.json_digest(pos)}
                self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(saveable), position=ocp.args.JsonSave(pos),
                    record=ocp.args.JsonSave(record)))
                self._saving = step
            if wait:
                self.manager.wait_until_finished()

    def _evaluated_later(self, step: int, pos: dict) -> None:
        """The position of the checkpoint of ``step`` once evaluated, beside it (``evaluated/STEP.json``, written
        whole; the checkpoint itself is never rewritten): a resume from it then goes on from its evaluation."""
        ocp = self._ocp
        if self._saving == step:
            self.manager.wait_until_finished()
        found = self.manager.restore(step, args=ocp.args.Composite(position=ocp.args.JsonRestore(),
                                                                   record=ocp.args.JsonRestore()))
        if found["position"].get("result") or jax.process_index() != 0:
            return
        path = self.directory / EVALUATED / f"{step}.json"
        path.parent.mkdir(exist_ok=True)
        atomic_write(path, json.dumps({"state_digest": found["record"]["state_digest"], "position": pos,
                                       "position_digest": integrity.json_digest(pos)}))

    def _later_position(self, step: int, record: dict) -> Position | None:
        """The evaluated position kept beside the checkpoint of ``step`` (``_evaluated_later``), if it is that
        checkpoint's (the same state digest: a step number saved again after a move aside has none) and whole."""
        path = self.directory / EVALUATED / f"{step}.json"
        if not path.is_file():
            return None
        try:
            kept = json.loads(path.read_text())
            if (kept["state_digest"], kept["position_digest"]) == (record["state_digest"],
                                                                   integrity.json_digest(kept["position"])):
                position = Position(**kept["position"])
                if position.total_steps == step and position.result:
                    return position
        except (OSError, ValueError, KeyError, TypeError):
            pass
        log.warning(f"{path} does not read, or is another checkpoint's: left out (the run evaluates step {step} "
                    "again)")
        return None

    def ensure_room(self, state: TrainState) -> None:
        """Room on disk for the checkpoints to come: ``keep`` + 1 at once (the newest is written before the
        oldest goes), each the state's bytes and orbax's metadata files; a one-line error if there is none."""
        more = max(self.keep + 1 - len(self.manager.all_steps()), 1)
        size = sum(x.nbytes for x in jax.tree.leaves(state)) + 2**16
        ensure_room(self.directory, more * size, f"{more} more checkpoint(s)", self.param)

    def committed(self, step: int) -> bool:
        """Whether a finished checkpoint of ``step`` is on disk."""
        self.manager.reload()
        return step in self.manager.all_steps()

    def latest(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def restore(self, like: TrainState) -> Restored | None:
        """The newest intact checkpoint, shaped and sharded like ``like``; None if there is none."""
        ocp = self._ocp
        self.manager.reload()
        damaged = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                record = self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
                self._check_compatible(step, record, like)
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(like)), position=ocp.args.JsonRestore()))
                problem = self._verify(record, restored)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted below: damage on disk, or anything else
                if not _damaged(e):
                    raise ConfigError(
                        f"restoring the checkpoint at step {step} in {self.directory} failed "
                        f"({type(e).__name__}: {_first_line(e)}); that is not damage on disk, so nothing was moved "
                        "aside: fix the cause (e.g. a changed orbax or jax version) and run again") from None
                problem = f"is unreadable ({_first_line(e)})"
            if problem:
                self._move_aside(step, problem)
                damaged.append(step)
                continue
            state = restored["state"]
            state = state.replace(rng=jax.random.wrap_key_data(state.rng, impl=jax.random.key_impl(like.rng)))
            position = Position(**restored["position"])
            if not position.result:  # saved before its evaluation: the evaluated position kept beside, if any
                position = self._later_position(step, record) or position
            return Restored(state, position, step, record["settings"])
        aside = self.directory / UNREADABLE
        if damaged or (aside.is_dir() and any(aside.iterdir())):  # a later resume too: never from scratch silently
            said = f"steps {', '.join(map(str, damaged))} are damaged" if damaged else "earlier found damaged"
            raise ConfigError(
                f"none of the checkpoints in {self.directory} could be restored ({said}; moved to {aside}): this run "
                f"cannot be resumed; start it anew with another {self.param} (or remove that directory)")
        return None

    def _check_compatible(self, step: int, record: dict, like: TrainState) -> None:
        saved = record["settings"]
        changed = [f"{k} {_said(saved.get(k))} -> {_said(self.settings.get(k))}" for k in self.fixed
                   if saved.get(k) != self.settings.get(k)]
        if changed:
            raise ConfigError(
                f"the checkpoint at step {step} in {self.directory} was written with other settings "
                f"({'; '.join(changed)}): resume with the same settings, or pass a new {self.param}")
        diffs = integrity.layout_differences(record["layout"], integrity.layout(_saveable(like)))
        if diffs:
            raise ConfigError(
                f"the checkpoint at step {step} in {self.directory} holds a differently shaped state "
                f"({'; '.join(diffs)}): was the model changed? Use the model it was written with, "
                f"or a new {self.param}")

    @staticmethod
    def _verify(record: dict, restored) -> str | None:
        if integrity.json_digest(restored["position"]) != record["position_digest"]:
            return "does not match the digest of its loop position written with it"
        if integrity.state_digest(restored["state"]) != record["state_digest"]:
            return "does not match the digest of its state written with it (damaged on disk)"
        return None

    def _move_aside(self, step: int, problem: str) -> None:
        where = self.directory / UNREADABLE / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            where.parent.mkdir(exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(where))
            later = self.directory / EVALUATED / f"{step}.json"
            if later.is_file():  # its evaluated position goes with it (a new save of that step has its own)
                shutil.move(str(later), str(where / f"{EVALUATED}.json"))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxtrain checkpoint {step} moved aside")
        self.manager.reload()
        log.warning(f"checkpoint at step {step} in {self.directory} {problem}: moved it to {where}")

    def close(self) -> None:
        """The saves in flight finished, the directory's lock released; once (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            with self._io(self._saving):
                self.manager.wait_until_finished()
        except BaseException:  # a save that failed (a full disk): its one line is the error, not close()'s raising
            with contextlib.suppress(Exception):  # the same failure again after it
                self.manager.close()
            raise
        else:
            with self._io(self._saving):
                self.manager.close()
        finally:  # the directory unlocked, whatever failed
            if self._lock is not None:
                self._lock.release()

    def _io(self, step):
        return _SaveErrors(self, step)


class _SaveErrors:
    """A failed save (full disk, vanished directory) becomes one ConfigError naming the newest good checkpoint."""

    def __init__(self, checkpointer: Checkpointer, step: int | None):
        self.checkpointer, self.step = checkpointer, step

    def __enter__(self):
        return self

    def __exit__(self, kind, e, _tb):
        if e is None or isinstance(e, (ConfigError, KeyboardInterrupt)):
            return False
        c = self.checkpointer
        try:
            good = c.latest()
        except Exception:  # noqa: BLE001 - the directory itself may be gone
            good = None
        cause = "the disk is full" if out_of_space(e) else _first_line(e)
        keep = f"the newest good checkpoint is step {good}" if good is not None else "no checkpoint was completed"
        raise ConfigError(f"saving a checkpoint in {c.directory} failed ({cause}); {keep}: "
                          f"make room (or fix the directory), then run again with {named('resume', True)}") from None


def _said(value) -> str:
    """A setting's value in a message: a setting not recorded (an optional one left off) is "not given"."""
    return "not given" if value is None else repr(value)
