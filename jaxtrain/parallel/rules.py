"""Where the parameters live: ``param_sharding`` made into rules, once (``ParamSharding``), and a
PartitionSpec per parameter from them.

``param_sharding`` = ``"replicated"`` (data parallelism), ``"fsdp"`` (ZeRO-3:
each parameter sharded over ``"data"`` along its largest dimension that
divides; on a hybrid mesh over "replica" and "data"), ``"hsdp"`` (fsdp over
"data" only: replicated across processes), ``"zero1"`` (the optimizer state
as fsdp's, the parameters replicated), the presets "tp" and "fsdp+tp" from a
model's logical axes, or rules: ``[(regex, PartitionSpec | "fsdp" |
FSDP(base) | "replicated"), ...]`` matched against the "/"-joined parameter
path, first match wins, unmatched = replicated.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtrain.choices import PARAM_SHARDINGS
from jaxtrain.errors import ConfigError, named
from jaxtrain.parallel.devices import MODEL_AXIS, REPLICA_AXIS
from jaxtrain.parallel.sharding import BATCH_AXES, axes_of, path_name, spec_entry

MIN_SIZE = 1024  # elements: smaller parameters stay replicated under FSDP (all-gathering them costs more than it saves)


@dataclasses.dataclass(frozen=True)
class FSDP:
    """A rule's value: ``base`` (e.g. a tensor-parallel spec), plus the batch axes on the largest free dimension
    that divides: ``"data"``, and ``"replica"`` too on a hybrid mesh unless ``within`` (HSDP: sharded within a
    process, replicated across)."""

    base: P = P()
    within: bool = False


PRESETS = PARAM_SHARDINGS  # the CLI's --param-sharding

# Logical axis names (what models annotate their parameters' dimensions with) -> the mesh axis that splits
# them (None: not split). Tensor parallelism splits a layer's hidden units, heads or output channels over
# "model"; the rest stays whole. A name not listed here is taken as a mesh axis name itself.
LOGICAL_AXES = {"mlp": MODEL_AXIS, "heads": MODEL_AXIS, "conv_out": MODEL_AXIS,
                "embed": None, "classes": None, "conv_in": None}

ZERO1 = "zero1"  # parameters replicated, optimizer state (and the gradients the update sees) sharded like fsdp's
HSDP = "hsdp"  # fsdp over "data" only: sharded within a process, replicated over "replica" (across processes)


def split(param_sharding) -> tuple:
    """(how the parameters are placed, how their optimizer state and the update's gradients are): the same for
    every sharding but ZeRO-1, which replicates the parameters and shards the rest as fsdp does."""
    return ("replicated", "fsdp") if param_sharding == ZERO1 else (param_sharding, param_sharding)


def logical_spec(names) -> P:
    """A PartitionSpec for one parameter's logical axis names, e.g. ``("embed", "mlp")`` -> ``P(None, "model")``."""
    return P(*(LOGICAL_AXES.get(n, n) if n is not None else None for n in names))


def preset(name: str, logical_axes=()) -> object:
    """The rules of a preset (``ParamSharding.of`` reads them); ``logical_axes``: the model's ((regex, names per
    dimension), ...)."""
    if name in ("replicated", "fsdp", ZERO1, HSDP):
        return name
    if name not in PRESETS:
        raise ConfigError(f"unknown {named('param_sharding', repr(name))}: use one of {', '.join(PRESETS)}")
    if not logical_axes:
        raise ConfigError(f"{named('param_sharding', name)}: this model has no tensor-parallel rules; use replicated "
                          "or fsdp")
    tp_rules = [(pattern, logical_spec(names)) for pattern, names in logical_axes]
    if name == "tp":
        return tp_rules
    return [(pattern, FSDP(spec)) for pattern, spec in tp_rules] + [(".*", "fsdp")]


def _rules(param_sharding) -> list[tuple[re.Pattern, object]]:
    if param_sharding == "replicated":
        return []
    if param_sharding == "fsdp":
        return [(re.compile(".*"), FSDP())]
    if param_sharding == HSDP:
        return [(re.compile(".*"), FSDP(within=True))]
    if isinstance(param_sharding, str) or not isinstance(param_sharding, (list, tuple)):
        raise ConfigError(f"param_sharding {param_sharding!r}: use 'replicated', 'fsdp', 'zero1', 'hsdp' or a list of "
                          "(regex, PartitionSpec | 'fsdp' | 'replicated') rules")
    rules = []
    for rule in param_sharding:
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(f"sharding rule {rule!r}: write each rule as "
                              "(regex, PartitionSpec | 'fsdp' | 'replicated')")
        pattern, value = rule
        if value == "fsdp":
            value = FSDP()
        if not (value == "replicated" or isinstance(value, (P, FSDP))):
            raise ConfigError(f"sharding rule {pattern!r}: {value!r} is not a PartitionSpec, 'fsdp' or 'replicated'")
        try:
            rules.append((re.compile(pattern), value))
        except re.error as e:
            raise ConfigError(f"sharding rule {pattern!r} is not a regular expression: {e}") from None
    return rules


def _checked(name: str, shape: tuple, spec: P, mesh: Mesh) -> tuple:
    """``spec`` padded to ``len(shape)`` entries, or a ConfigError saying what does not fit."""
    if len(spec) > len(shape):
        raise ConfigError(f"parameter {name} {shape}: PartitionSpec {spec} has more entries than dimensions")
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    seen = []
    for dim, entry in zip(shape, entries):
        axes = axes_of(entry)
        for axis in axes:
            if axis not in mesh.shape:
                raise ConfigError(f"parameter {name}: PartitionSpec {spec} names axis {axis!r} but the mesh has "
                                  f"only {', '.join(mesh.axis_names)} (give {named('mesh')} that axis, e.g. "
                                  f"data=2,{axis}=2)")
            if axis in seen:
                raise ConfigError(f"parameter {name}: PartitionSpec {spec} uses axis {axis!r} twice")
            seen.append(axis)
        ways = math.prod(mesh.shape[a] for a in axes)
        if dim % ways:
            raise ConfigError(f"parameter {name} {shape}: PartitionSpec {spec} splits a dimension of {dim} "
                              f"{ways} ways; it does not divide (change the rule or the mesh)")
    return entries


def _fsdp(entries: tuple, shape: tuple, mesh: Mesh, min_size: int, within: bool = False) -> tuple:
    """``entries`` plus the batch axes (``within``: "data" only) on the largest free dimension divisible by
    their size (ties: the last)."""
    over = tuple(a for a in BATCH_AXES if a in mesh.shape and not (within and a == REPLICA_AXIS))
    n = math.prod(mesh.shape[a] for a in over)
    used = {a for e in entries for a in axes_of(e)}
    if n == 1 or used & set(over) or math.prod(shape) < min_size:
        return entries
    free = [d for d, e in enumerate(entries) if e is None and shape[d] % n == 0]
    if not free:
        return entries
    best = max(free, key=lambda d: (shape[d], d))
    return entries[:best] + (spec_entry(over),) + entries[best + 1:]


@dataclasses.dataclass(frozen=True)
class ParamSharding:
    """``param_sharding`` made once, at the boundary, into what the plan, the strategies and the summary read:
    the rules that place the parameters (and Frozen model state), those that place their optimizer state and
    the gradients the update sees (``updated``: ZeRO-1's differ), FSDP's smallest sharded size, and the
    setting's name (a preset's, or "rules").

    ``ParamSharding.of`` takes what users write: a preset ("replicated", "fsdp", "zero1", "hsdp"; "tp" and
    "fsdp+tp" given the model's ``logical_axes``), a list of (regex, PartitionSpec | FSDP | "fsdp" |
    "replicated") rules, or a ParamSharding; a malformed one is a ConfigError there."""

    placed: tuple
    updated: tuple
    min_size: int = MIN_SIZE
    name: str = "rules"

    @classmethod
    def of(cls, param_sharding, min_size: int = MIN_SIZE, logical_axes=()) -> ParamSharding:
        if isinstance(param_sharding, ParamSharding):
            return param_sharding
        name = param_sharding if isinstance(param_sharding, str) else "rules"
        if name in ("tp", "fsdp+tp"):
            param_sharding = preset(name, logical_axes)
        placed, updated = split(param_sharding)
        return cls(tuple(_rules(placed)), tuple(_rules(updated)), min_size, name)

    def specs(self, params, mesh: Mesh, updated: bool = False):
        """A PartitionSpec per parameter (``params``: arrays or shapes), or per optimizer-state parameter
        (``updated``); ConfigError before anything compiles."""
        rules = self.updated if updated else self.placed

        def spec(path, leaf):
            name, shape = path_name(path), tuple(np.shape(leaf))
            value = next((v for pattern, v in rules if pattern.search(name)), "replicated")
            if value == "replicated":
                return P()
            if isinstance(value, FSDP):
                return P(*_fsdp(_checked(name, shape, value.base, mesh), shape, mesh, self.min_size, value.within))
            return P(*_checked(name, shape, value, mesh))

        return jax.tree_util.tree_map_with_path(spec, params)


def param_specs(params, param_sharding, mesh: Mesh, min_size: int = MIN_SIZE):
    """A PartitionSpec per parameter placed by ``param_sharding`` (``ParamSharding.of``'s forms)."""
    return ParamSharding.of(param_sharding, min_size).specs(params, mesh)
