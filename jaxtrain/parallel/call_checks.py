"""What a trainer checks where the user calls it, each in one line that names what differs.

All of it is cheap: shapes, dtypes and tree structures are static, so they
are compared on the host without waiting for the devices; the one value read
back, a scalar per step, is read when its step is done (the first step's: once
it is, the one wait).

- The state: its tree against the one this trainer's optimizer and precision
  make (``structure``: once per new structure), its arrays' placement against
  the plan (``Plan.check_placed``, each checked call).
- The batch: a step that cannot be traced for it (a shape, dtype or key the
  loss_fn does not take) is said as one line naming the batch's arrays and,
  where an earlier batch ran, the ones that differ from it (``untraceable``).
- The labels: jaxtrain's loss helpers report the fraction of labels outside
  the classes as the metric ``LABELS_OUT_OF_RANGE`` and give those examples a
  NaN loss (``jaxtrain.models.classify``): its gradient is masked out, so the
  state stays finite. Every step's metric is read and raises if it is not 0
  (``labels``). When (``Trainer.check_labels``, for ``trainer(state, batch)``
  and ``trainer.step`` alike): the first call reads its own once its step is
  done (the one wait, once; that call's state is gone, donated to its step,
  and the error says so); every later call, before its step takes (donates)
  its state, reads those of all earlier calls whose step is done (a poll,
  no wait) and that of the call before the previous one in any case (one
  step stays in flight, so it is all but done): a bad batch raises at most
  two calls later, the state given to the raising call still usable. The
  last calls have no later call: ``trainer.check_labels()`` waits for and
  reads them (``jaxtrain.train.loop.fit`` calls it at each epoch's end, and
  also reads each step's metric one step late with its loss, before calling
  a NaN loss a divergence). An evaluation's: ``classify.per_example`` flags
  each example, the eval step sums the flags of the unmasked ones, and
  ``jaxtrain.train.loop.evaluate`` raises the same error for the evaluation
  set (before its NaN loss could end a run as diverged).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxtrain.choices import LABELS_OUT_OF_RANGE
from jaxtrain.core.state import TrainState
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel.sharding import path_name

# What tracing a step raises for a batch its loss_fn cannot take (shapes, dtypes, a missing key).
TRACE_ERRORS = (TypeError, ValueError, KeyError)


def _name(path) -> str:
    return path_name(path) or "(the whole tree)"


def _outline(tree) -> str:
    """A short description of a tree's top: its node types (an optimizer's states, a loss scale's keys)."""
    if tree is None:
        return "none"
    if isinstance(tree, (tuple, list)):
        return "(" + ", ".join(type(t).__name__ for t in tree) + ")"
    if isinstance(tree, dict):
        return "{" + ", ".join(map(str, tree)) + "}"
    return type(tree).__name__


def not_donated(state) -> None:
    """A donated state's buffers are gone; reusing it segfaulted jaxlib 0.10.2 on 2+ CPU devices."""
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise ConfigError("this TrainState was donated to an earlier step and its buffers are gone: "
                          "pass the state the previous call returned (state, metrics = trainer(state, batch))")


def structure(state, expected: Callable[[], TrainState]) -> None:
    """A ConfigError unless ``state`` has the tree of ``expected()`` (what the trainer makes for its params)."""
    if not isinstance(state, TrainState):
        raise ConfigError(f"trainer(state, batch) takes the TrainState trainer.init made; got {type(state).__name__}")
    expected = expected()
    for field in dataclasses.fields(TrainState):
        got, want = getattr(state, field.name), getattr(expected, field.name)
        if jax.tree.structure(got) == jax.tree.structure(want):
            continue
        detail = f"{_outline(got)} in the state, {_outline(want)} from this trainer"
        if _outline(got) == _outline(want):
            only = {_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(got)[0]} - {
                _name(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]}
            detail = f"the state has {min(only)!r}, this trainer does not" if only else "trees differ"
        why = {"opt_state": f" (another optimizer, or {named('accum_steps')})",
               "loss_scale": f" (another {named('precision')})"}
        raise ConfigError(f"state does not match this trainer: its {field.name} differs{why.get(field.name, '')}: "
                          f"{detail}; pass a state this trainer made (trainer.init, or a checkpoint restored "
                          "with it)")


def placement(state, want_leaves: list) -> None:
    """A ConfigError naming the first array of ``state`` not placed as ``want_leaves`` (a sharding per leaf)."""
    for x, want in zip(jax.tree.leaves(state), want_leaves):
        if isinstance(x, jax.Array) and x.sharding != want and not x.sharding.is_equivalent_to(want, x.ndim):
            path = next(p for p, y in jax.tree_util.tree_flatten_with_path(state)[0] if y is x)
            got = x.sharding
            where = (f"{got.spec} on mesh {dict(got.mesh.shape)}" if isinstance(got, jax.sharding.NamedSharding)
                     else type(got).__name__)
            raise ConfigError(f"state does not match this trainer: {_name(path)} is placed {where} but this "
                              f"trainer places it {want.spec} on mesh {dict(want.mesh.shape)} (a state from a "
                              "trainer with another mesh or param_sharding); pass a state this trainer made, or "
                              "move it: jax.device_put(state, trainer.plan(state).state)")


def signature(batch) -> dict[str, str]:
    """``{name: "shape dtype"}`` of a batch's arrays (or shapes)."""
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    return {_name(p): f"{tuple(np.shape(x))} {np.dtype(x.dtype).name}" for p, x in flat}


def untraceable(error: Exception, batch, previous: dict[str, str] | None) -> ConfigError:
    """The one-line error for a step that could not be traced for ``batch``; ``previous``: the signature of the
    last batch that ran (None: none has)."""
    first = (str(error).splitlines() or [""])[0][:300]
    cause = f"{type(error).__name__}: {first}"
    now = signature(batch)
    if previous:
        changed = [f"batch['{k}'] is {v} but was {previous[k]}" for k, v in now.items() if previous.get(k, v) != v]
        changed += [f"batch['{k}'] is new" for k in now if k not in previous]
        changed += [f"batch['{k}'] is missing" for k in previous if k not in now]
        if changed:
            return ConfigError(f"{'; '.join(changed)} in the batch that last ran: the step cannot be traced for "
                               f"it ({cause})")
    arrays = ", ".join(f"{k} {v}" for k, v in now.items())
    return ConfigError(f"the step cannot be traced for this batch ({arrays}): {cause}; check its arrays' shapes "
                       "and dtypes against what the loss_fn takes")


def labels(share, where: str, values=None, consumed: bool = False) -> None:
    """A ConfigError if ``share``, a step's metric ``LABELS_OUT_OF_RANGE``, is not 0: labels outside the model's
    classes in the batch ``where`` names (``values``: its labels, to say their range; ``consumed``: the raising
    call's own step took the state it was given). A call of K steps: ``share`` [K] and ``values`` [K, ...]; the
    first step whose share is not 0 is said."""
    shares = np.asarray(jax.device_get(share), np.float64)
    bad = np.flatnonzero(shares.reshape(-1))
    if not bad.size:
        return
    if shares.ndim:  # K steps in one call: the first bad one
        first = int(bad[0])
        where = f"{where} (its step {first + 1} of {shares.size})"
        share, values = shares.reshape(-1)[first], None if values is None else values[first]
    share = float(share)
    found = ""
    if values is not None and getattr(values, "is_fully_addressable", True):
        values = np.asarray(jax.device_get(values))
        found = f" (they range {values.min()}..{values.max()})"
    gone = ("; its step ran and consumed (donated) the state this call was given: start again from trainer.init "
            "or a checkpoint" if consumed else "")
    raise ConfigError(f"{share:.1%} of the labels of {where} are outside the model's classes{found}: labels are "
                      f"class indices 0..num_classes-1 (their loss is NaN); fix the labels{gone}")


class PendingLabels:
    """The labels' share (``LABELS_OUT_OF_RANGE``) of each call of a step, checked without waiting where it can.

    ``held(out, state, batch)`` after each call: the first call's checked at once (one wait, once), saying
    whether the state it was given is gone (donated to its step); a later call's held. ``read()`` before each
    call takes its state: every held call whose step is done (never waiting for one), and the call before the
    previous one in any case (its step is all but done). ``read(wait=True)``: all of them. So a bad batch raises
    at most two calls later, the state given to the raising call still usable."""

    def __init__(self):
        self._unread = collections.deque()  # (call, share, labels) not checked yet
        self._calls = 0

    def read(self, wait: bool = False) -> None:
        while self._unread:
            call, share, values = self._unread[0]
            if not (wait or len(self._unread) > 1 or getattr(share, "is_ready", lambda: True)()):
                return
            self._unread.popleft()
            labels(share, f"the batch of call {call}", values)

    def held(self, out: tuple, state, batch) -> tuple:
        """``out`` (state, metrics) of a call, its labels' share held (or, the first call's, checked)."""
        self._calls += 1
        if LABELS_OUT_OF_RANGE not in out[1]:
            return out
        share, values = out[1][LABELS_OUT_OF_RANGE], batch.get("label")
        if self._calls > 1:
            self._unread.append((self._calls, share, values))
            return out
        consumed = any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state))
        labels(share, "the batch of call 1", values, consumed=consumed)
        return out

