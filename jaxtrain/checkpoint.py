"""Orbax checkpoints of the TrainState and the data position, with exact resume.

A checkpoint (one orbax step, numbered by train steps) holds the TrainState
(params, optimizer state, model state, loss scale, RNG) and the loop's
``Position`` (epoch, next batch, metric sums so far) as JSON. Saving is
asynchronous where orbax offers it; the newest ``keep`` checkpoints are kept.
Restoring tries the newest first and falls back to older ones when a
checkpoint is partial or corrupt.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax

from jaxtrain.errors import ConfigError
from jaxtrain.loop import Position
from jaxtrain.report import ensure_writable
from jaxtrain.state import TrainState


def _saveable(state: TrainState) -> TrainState:
    """Typed PRNG keys are stored as their uint32 data."""
    return state.replace(rng=jax.random.key_data(state.rng))


def _abstract(state: TrainState):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _saveable(state))


class Checkpointer:
    """Save and restore ``(TrainState, Position)`` in ``directory`` with orbax."""

    def __init__(self, directory: str | Path, keep: int = 3):
        import orbax.checkpoint as ocp

        if keep < 1:
            raise ConfigError(f"--keep-checkpoints must be >= 1, got {keep}")
        self.directory = ensure_writable(Path(directory).absolute(), "checkpoints to", "--checkpoint-dir")
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True))

    def save(self, state: TrainState, position: Position, wait: bool = False) -> None:
        """Save at step ``position.total_steps`` (asynchronously unless ``wait``)."""
        ocp = self._ocp
        step = position.total_steps
        if step not in self.manager.all_steps():
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_saveable(state)),
                                                            position=ocp.args.JsonSave(dataclasses.asdict(position))))
        if wait:
            self.manager.wait_until_finished()

    def restore(self, like: TrainState) -> tuple[TrainState, Position] | None:
        """The newest readable checkpoint, shaped and sharded like ``like``; None if there is none."""
        ocp = self._ocp
        self.manager.reload()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(like)), position=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001 - a partial or corrupt checkpoint: try the previous one
                reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                print(f"warning: checkpoint at step {step} in {self.directory} is unreadable ({reason}); "
                      "trying the previous one", file=sys.stderr, flush=True)
                continue
            state = restored["state"]
            state = state.replace(rng=jax.random.wrap_key_data(state.rng, impl=jax.random.key_impl(like.rng)))
            return state, Position(**restored["position"])
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
