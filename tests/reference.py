"""An independent reference train step, for the tests only: no jaxtrain code on its path.

Written from the documented contract (README.md "In Python", docs/train-step.md
"Using the library" and "Randomness: the key a loss_fn receives",
precision.py's and step.py's docstrings), not from jaxtrain's code: plain
``jax.value_and_grad`` of the model's loss, ``tx.update`` and
``optax.apply_updates``, micro-batches in a Python loop, an explicit fp16
loss scale, and the key rule spelled out. ``tests/test_reference.py`` holds
``make_train_step`` on 1 device equal to it; every equivalence test then
compares N devices with that 1-device step, so a bug on the shared path
(the cast, the scaling, the update, the key rule) fails a test.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16,
          "fp64": jnp.float64}  # fp64: the exact values of tests/tolerance.py (under jax.enable_x64)


@dataclasses.dataclass
class LossScale:
    """fp16's dynamic loss scale, as documented: x2 after ``growth`` finite steps, /2 (floor 1) on overflow."""

    scale: float = 2.0**15
    good: int = 0
    growth: int = 2000


def _to_compute(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@functools.partial(jax.jit, static_argnums=(0, 5))  # compiled, as the step is: the same fusions' rounding
def _grads(loss_fn, params, model_state, batch, rng, dtype, scale):
    """fp32 (fp64 in fp64) gradients of ``scale`` x the loss computed in ``dtype``; the loss, new model state and
    metrics."""
    wide = jnp.promote_types(dtype, jnp.float32)

    def scaled(p):
        loss, (new_state, metrics) = loss_fn(_to_compute(p, dtype), model_state, _to_compute(batch, dtype), rng)
        loss = loss.astype(wide)
        return loss * scale, (loss, new_state, metrics)

    (_, aux), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    return jax.tree.map(lambda g: g.astype(wide), grads), *aux


def _micro_batches(batch, k):
    """Micro-batch j of k: rows j, j + k, j + 2k, ... (the documented strided split)."""
    return [jax.tree.map(lambda x: x[j::k], batch) for j in range(k)]


def _mean(trees):
    def wide(x):  # fp64 stays fp64
        return x.astype(jnp.promote_types(x.dtype, jnp.float32))

    return jax.tree.map(lambda *xs: sum(wide(x) for x in xs) / len(xs), *trees)


def _mean_in(trees, dtype):
    """The mean of fp32 trees summed in ``dtype`` (each term scaled first: exact for a power-of-two count)."""
    return jax.tree.map(lambda *xs: sum(x.astype(dtype) / len(xs) for x in xs).astype(jnp.float32), *trees)


def _all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


class Reference:
    """The plain 1-device step: ``ref.step(batch)`` updates ``ref.params``, ``ref.opt_state``, ... in place.

    ``precision``: "fp32" | "bf16" | "fp16" (fp16: a dynamic loss scale).
    ``accum_steps`` k with ``accum="scan"``: one step averages k micro-batch
    gradients; ``"multisteps"``: one step is one micro-batch, the optimizer
    applies the mean of k of them every k-th step.
    ``devices`` d: the batch split into d blocks, one gradient each, their
    mean summed in ``reduce_dtype`` (a ``jt.Precision``'s reduce_dtype).
    """

    def __init__(self, loss_fn, tx, params, model_state=None, rng=None, precision="fp32", accum_steps=1,
                 accum="scan", loss_scale: LossScale | None = None, devices: int = 1, reduce_dtype=jnp.float32):
        self.loss_fn, self.tx, self.dtype, self.reduce_dtype = loss_fn, tx, DTYPES[precision], reduce_dtype
        self.k, self.accum, self.devices = accum_steps, accum, devices
        self.params = jax.tree.map(jnp.asarray, params)
        self.opt_state = tx.init(self.params)
        self.model_state = {} if model_state is None else model_state
        self.rng = jax.random.key(0) if rng is None else rng
        self.loss_scale = (loss_scale or LossScale()) if precision == "fp16" else None
        self.step_count = 0
        self.pending = []  # multisteps: the micro-batch gradients since the last update

    def step(self, batch) -> dict:
        batch = jax.tree.map(jnp.asarray, batch)
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale
        step_key = jax.random.fold_in(self.rng, self.step_count)
        scan = self.k if self.accum == "scan" else 1
        size = len(jax.tree.leaves(batch)[0]) // self.devices
        shares, states = [], []
        for d in range(self.devices):
            block = jax.tree.map(lambda x: x[d * size:(d + 1) * size], batch)
            device_key = jax.random.fold_in(step_key, d)
            keys = jax.random.split(device_key, scan) if scan > 1 else [device_key]
            model_state, parts = self.model_state, []
            for micro, key in zip(_micro_batches(block, scan) if scan > 1 else [block], keys):
                grads, loss, model_state, metrics = _grads(self.loss_fn, self.params, model_state, micro, key,
                                                           self.dtype, scale)
                parts.append((grads, loss, metrics))
            shares.append(_mean(parts) if scan > 1 else parts[0])
            states.append(model_state)
        grads, loss, metrics = _mean(shares) if self.devices > 1 else shares[0]
        if self.devices > 1 and self.reduce_dtype != jnp.float32:
            grads = _mean_in([share[0] for share in shares], self.reduce_dtype)
        self.model_state = _mean(states) if self.devices > 1 else states[0]
        grads = jax.tree.map(lambda g: g / scale, grads)
        out = {"loss": loss, **metrics}
        finite = _all_finite(grads)
        if self.loss_scale is not None:
            out.update(loss_scale=np.float32(scale), grads_finite=np.float32(finite))
        if finite:
            self._apply(grads)
        if self.loss_scale is not None:
            ls = self.loss_scale
            ls.good = ls.good + 1 if finite else 0
            if not finite:
                ls.scale = max(ls.scale / 2, 1.0)
            elif ls.good >= ls.growth:
                ls.scale, ls.good = ls.scale * 2, 0
        self.step_count += 1
        return jax.device_get(out)

    def _apply(self, grads):
        if self.accum == "multisteps" and self.k > 1:
            self.pending.append(grads)
            if len(self.pending) < self.k:
                return
            grads, self.pending = _mean(self.pending), []
        self.params, self.opt_state = _update(self.tx, grads, self.opt_state, self.params)


@functools.partial(jax.jit, static_argnums=0)
def _update(tx, grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _to64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64) if np.issubdtype(np.asarray(x).dtype, np.floating)
                        else x, tree)


class Exact(NamedTuple):
    """The float64 run of ``float64_steps``: final state, metrics, and where params and model state started."""

    params: Any
    opt_state: Any
    model_state: Any
    history: list
    start_params: Any
    start_model_state: Any


def float64_steps(loss_fn, tx, params, batches, model_state=None, rng=None, **kw) -> Exact:
    """The reference's steps in float64 (numpy float64): the exact values of the tolerance policy
    (tests/tolerance.py).

    ``kw``: accum_steps, accum, devices (fp32 runs only: a low precision is
    compared with its own-precision reference instead). A model that draws
    random numbers draws other ones in float64: not for dropout.
    """
    with jax.enable_x64(True):
        ref = Reference(loss_fn, tx, _to64(params), _to64(model_state), rng=rng, precision="fp64", **kw)
        history = [ref.step(_to64(batch)) for batch in batches]
        return Exact(*jax.device_get((ref.params, ref.opt_state, ref.model_state, history)), _to64(params),
                     _to64({} if model_state is None else model_state))


def reference_runs(loss_fn, make_tx, params, batches, model_state=None, **kw):
    """(final state, metrics history, float64 run) of this reference on ``batches``: what an N-device run is held
    to by the tolerance policy (tests/tolerance.py). ``make_tx()`` makes a fresh optimizer; ``kw``: fp32 ones."""
    ref = Reference(loss_fn, make_tx(), params, model_state, **kw)
    history = [ref.step(batch) for batch in batches]
    state = types.SimpleNamespace(step=ref.step_count, params=ref.params, opt_state=ref.opt_state,
                                  model_state=ref.model_state)
    exact = float64_steps(loss_fn, make_tx(), params, batches, model_state, **kw)
    return jax.device_get(state), history, exact


def assert_matches(state, history, loss_fn, tx, params, batches, model_state=None, rng=None, tol=None, **kw):
    """jaxtrain's 1-device ``state`` and metrics ``history`` after ``batches`` equal this reference's.

    ``tx``: a fresh optimizer like the trainer's; ``rng``: the trainer's init
    key (default: its default, key 0); ``kw``: precision, accum_steps, accum,
    loss_scale. What the equivalence tests' 1-device runs call once per
    configuration, so their N-device comparisons rest on independent code.
    fp32: by the tolerance policy (tests/tolerance.py), returning the float64
    run the N-device runs are then held to; a low precision: within ``tol``
    of the same-precision reference, returning None.
    """
    import chex
    from tolerance import assert_state_reassociated

    ref = Reference(loss_fn, tx, params, model_state, rng=rng, **kw)
    want = [ref.step(batch) for batch in batches]
    host = jax.device_get(state)
    assert int(host.step) == ref.step_count
    opt_state = host.opt_state.inner_opt_state if ref.accum == "multisteps" and ref.k > 1 else host.opt_state
    got = [{k: m[k] for k in w} for m, w in zip(jax.device_get(history), want)]
    if kw.get("precision", "fp32") == "fp32" and tol is None:
        fp64 = {k: kw[k] for k in ("accum_steps", "accum") if k in kw}
        exact = float64_steps(loss_fn, tx, params, batches, model_state, rng=rng, **fp64)
        mine = host.replace(opt_state=opt_state)
        theirs = host.replace(params=ref.params, opt_state=ref.opt_state, model_state=ref.model_state)
        assert_state_reassociated(mine, got, jax.device_get(theirs), want, exact)
        return exact
    tol = tol or {"rtol": 1e-5, "atol": 1e-5}  # see test_reference.TOL
    chex.assert_trees_all_close(host.params, jax.device_get(ref.params), **tol)
    chex.assert_trees_all_close(opt_state, jax.device_get(ref.opt_state), **tol)
    chex.assert_trees_all_close(host.model_state, jax.device_get(ref.model_state), **tol)
    chex.assert_trees_all_close(got, want, **tol)
    if ref.loss_scale is not None:
        assert float(host.loss_scale["scale"]) == ref.loss_scale.scale
    return None
