"""Optimizers and learning-rate schedules from optax, by name: what ``--optimizer``, ``--schedule`` ... build.

``make_optimizer("nesterov", 0.1, schedule="onecycle", total_steps=n, ...)``
is one optax chain: ``clip_by_global_norm`` (``clip_grad_norm``), then
weight decay, then the optimizer, inside ``optax.inject_hyperparams`` so
that the learning rate each update used is in the optimizer state
(``learning_rate(opt_state)``; the train step reports it as ``metrics["lr"]``).

The update runs on global arrays under every strategy and sharding
(``parallel.py``), so the clip sees the GLOBAL gradient norm, also under
FSDP and ``shard_map`` / ``ring``.
"""

from __future__ import annotations

import functools
import re

import jax
import optax

from jaxtrain.choices import LR_SCHEDULES, OPTIMIZERS
from jaxtrain.errors import ConfigError, named

MOMENTUM = 0.9


def decayed(params):
    """Which parameters weight decay applies to: kernels and embeddings (2+ dimensions), not biases or norm scales."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_schedule(name: str, lr: float, total_steps: int | None = None, warmup_steps: int = 0) -> optax.Schedule:
    """The learning rate per optimizer update: constant, cosine (to 0 at ``total_steps``), warmup_cosine (linear
    from 0 over ``warmup_steps``, then cosine to 0), onecycle (up to ``lr`` over ``warmup_steps``, default 30%
    of the run, then down; optax.cosine_onecycle_schedule)."""
    if name not in LR_SCHEDULES:
        raise ConfigError(f"unknown learning-rate schedule {name!r}: use one of {', '.join(LR_SCHEDULES)}")
    if name == "constant":
        return optax.constant_schedule(lr)
    if not total_steps or total_steps < 1:
        raise ConfigError(f"schedule {name!r} needs the run's length: total_steps >= 1, got {total_steps}")
    if not 0 <= warmup_steps < total_steps:
        raise ConfigError(f"warm-up of {warmup_steps} steps does not fit a run of {total_steps} steps: use fewer "
                          f"{named('warmup_epochs')} or more {named('epochs')}")
    if name == "cosine":
        return optax.cosine_decay_schedule(lr, total_steps)
    if name == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps)
    return optax.cosine_onecycle_schedule(total_steps, lr, pct_start=warmup_steps / total_steps if warmup_steps
                                          else 0.3)


def make_optimizer(name: str, lr: float, *, schedule: str = "constant", total_steps: int | None = None,
                   warmup_steps: int = 0, weight_decay: float = 0.0, clip_grad_norm: float | None = None,
                   momentum: float = MOMENTUM, freeze: str | None = None,
                   lr_groups: tuple[tuple[str, float], ...] = ()) -> optax.GradientTransformation:
    """``name``: sgd | momentum | nesterov (SGD with ``momentum``) | adam | adamw (decoupled weight decay).

    ``weight_decay`` on the others is the classic L2 term added to the
    gradient (PyTorch's ``weight_decay``); either way only ``decayed``
    parameters. ``clip_grad_norm``: rescale the gradient to this global norm
    at most, before anything else.

    Fine-tuning (``param_groups`` labels each parameter): ``freeze``, a regex over parameter names
    (``blocks/0/conv1/kernel``): the parameters it matches are never updated and get no optimizer state;
    ``lr_groups``, ((regex, lr), ...): a parameter takes the lr of the first regex that matches it (the same
    schedule, scaled), the rest ``lr``. The clip sees only the gradients of parameters that train.
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")
    if weight_decay < 0 or (clip_grad_norm is not None and clip_grad_norm <= 0):
        raise ConfigError(f"weight decay must be >= 0 and the clip norm > 0; got {weight_decay}, {clip_grad_norm}")
    grouped = bool(freeze or lr_groups)

    def chain(learning_rate):
        parts = [optax.clip_by_global_norm(clip_grad_norm)] if clip_grad_norm and not grouped else []
        if name == "adamw":
            return optax.chain(*parts, optax.adamw(learning_rate, weight_decay=weight_decay, mask=decayed))
        if weight_decay:
            parts.append(optax.add_decayed_weights(weight_decay, mask=decayed))
        parts.append({"sgd": lambda: optax.sgd(learning_rate),
                      "momentum": lambda: optax.sgd(learning_rate, momentum=momentum),
                      "nesterov": lambda: optax.sgd(learning_rate, momentum=momentum, nesterov=True),
                      "adam": lambda: optax.adam(learning_rate)}[name]())
        return optax.chain(*parts)

    def scheduled(peak: float):
        return optax.inject_hyperparams(chain)(learning_rate=make_schedule(name=schedule, lr=peak,
                                                                            total_steps=total_steps,
                                                                            warmup_steps=warmup_steps))

    if not grouped:
        return scheduled(lr)
    labels = functools.partial(param_groups, freeze=freeze, lr_groups=lr_groups)
    # "base" sorts first: learning_rate(opt_state) reports the base group's
    groups = {"base": scheduled(lr), FROZEN: optax.set_to_zero(),
              **{f"group{i}": scheduled(group_lr) for i, (_, group_lr) in enumerate(lr_groups)}}
    inner = optax.multi_transform(groups, labels)
    if not clip_grad_norm:
        return inner
    frozen = functools.partial(_is_frozen, labels)
    return optax.chain(optax.masked(optax.set_to_zero(), frozen), optax.clip_by_global_norm(clip_grad_norm), inner)


FROZEN = "frozen"


def param_name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def param_groups(params, freeze: str | None = None, lr_groups: tuple[tuple[str, float], ...] = ()):
    """Each parameter's group: "frozen" (``freeze`` matches its name), "groupI" (the first of ``lr_groups``'
    regexes that matches), else "base"."""
    patterns = [re.compile(p) for p, _ in lr_groups]
    frozen = re.compile(freeze) if freeze else None

    def label(path, _):
        name = param_name(path)
        if frozen is not None and frozen.search(name):
            return FROZEN
        return next((f"group{i}" for i, p in enumerate(patterns) if p.search(name)), "base")

    return jax.tree_util.tree_map_with_path(label, params)


def _is_frozen(labels, params):
    return jax.tree.map(lambda group: group == FROZEN, labels(params))


def check_groups(params, freeze: str | None, lr_groups: tuple[tuple[str, float], ...]) -> list[str]:
    """The one-line problems of ``freeze`` / ``lr_groups`` on these parameters (shapes will do): a regex that
    does not compile, one that matches no parameter, nothing left to train. Each line names the parameters."""
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    problems = []
    for what, pattern in [("freeze", freeze)] * bool(freeze) + [("lr_groups", p) for p, _ in lr_groups]:
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            problems.append(f"{what}: {pattern!r} is not a regular expression ({e})")
            continue
        if not any(compiled.search(n) for n in names):
            problems.append(f"{what}: {pattern!r} matches no parameter (they are named like {', '.join(names[:3])})")
    if not problems and freeze and all(re.search(freeze, n) for n in names):
        problems.append(f"freeze: {freeze!r} matches every parameter: nothing would train")
    return problems


def learning_rate(opt_state):
    """The learning rate of the newest update, from ``inject_hyperparams`` state anywhere in ``opt_state``
    (e.g. inside ``optax.MultiSteps``); None if the optimizer does not record one."""

    def has(x):
        return hasattr(x, "hyperparams") and "learning_rate" in x.hyperparams

    found = [x for x in jax.tree.leaves(opt_state, is_leaf=has) if has(x)]
    return found[0].hyperparams["learning_rate"] if found else None
