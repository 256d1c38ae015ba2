"""Where the batch and the training state live on the mesh: written once, used by every strategy.

- The batch: sharded over ``"data"`` (its leading axis; a hybrid mesh: over
  ``("replica", "data")``), replicated over every other mesh axis
  (``placement.Plan``, which holds all of a step's placement).
- The parameters: ``param_sharding`` = ``"replicated"`` (data parallelism),
  ``"fsdp"`` (ZeRO-3: each parameter sharded over ``"data"`` along its largest
  dimension that divides; on a hybrid mesh over "replica" and "data"),
  ``"hsdp"`` (fsdp over "data" only: replicated across processes),
  ``"zero1"`` (the optimizer state as fsdp's, the parameters replicated) or
  rules: ``[(regex, PartitionSpec | "fsdp" |
  FSDP(base) | "replicated"), ...]`` matched against the "/"-joined parameter
  path, first match wins, unmatched = replicated (``param_specs``).
- The optimizer state follows its parameter (``optax.tree_map_params`` over
  ``jax.eval_shape(tx.init, ...)``); ``Frozen`` model state (a distillation
  teacher's weights) is placed by the same rules as the parameters; step,
  rng, loss scale and the rest of the model state (e.g. BatchNorm
  statistics) are replicated (``state_specs``).
- ``place``: host values onto any sharding, as new global arrays.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.choices import PARAM_SHARDINGS
from jaxtrain.core.state import Frozen, is_frozen
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.devices import DATA_AXIS, MODEL_AXIS, REPLICA_AXIS

MIN_SIZE = 1024  # elements: smaller parameters stay replicated under FSDP (all-gathering them costs more than it saves)
BATCH_AXES = (REPLICA_AXIS, DATA_AXIS)  # what the batch may be split over (devices.batch_axes): FSDP's axes too


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
        raise ConfigError(f"unknown param_sharding={name!r}: use one of {', '.join(PRESETS)}")
    if not logical_axes:
        raise ConfigError(f"param_sharding={name}: this model has no tensor-parallel rules; use replicated or fsdp")
    tp_rules = [(pattern, logical_spec(names)) for pattern, names in logical_axes]
    if name == "tp":
        return tp_rules
    return [(pattern, FSDP(spec)) for pattern, spec in tp_rules] + [(".*", "fsdp")]


def is_spec(x) -> bool:
    return isinstance(x, P)


def axes_of(entry) -> tuple:
    """The mesh axes one PartitionSpec entry names: None -> (), "data" -> ("data",), ("data", "model") as is."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def data_only(spec: P) -> P:
    """``spec`` with only its batch axes ("data", "replica": what a shard_map manual over them alone sees)."""
    return P(*(_entry(tuple(a for a in axes_of(e) if a in BATCH_AXES)) for e in spec))


def without_data(spec: P) -> P:
    """``spec`` gathered over the batch axes: its other axes (e.g. "model") kept."""
    return P(*(_entry(tuple(a for a in axes_of(e) if a not in BATCH_AXES)) for e in spec))


def path_name(path) -> str:
    """``("dense1", "w")`` -> ``"dense1/w"``: what rules match."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


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
                                  f"only {', '.join(mesh.axis_names)} (give mesh= that axis, e.g. data=2,{axis}=2)")
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
    return entries[:best] + (_entry(over),) + entries[best + 1:]


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


def mesh_axes_used(specs) -> set[str]:
    """The mesh axes any spec in ``specs`` shards over."""
    axes = set()
    for spec in jax.tree.leaves(specs, is_leaf=is_spec):
        for e in spec:
            axes.update(axes_of(e))
    return axes


def data_dims(specs):
    """Per parameter: the dimension sharded over ``"data"`` (FSDP), or None."""

    def dim(spec):
        hits = [d for d, e in enumerate(spec) if DATA_AXIS in axes_of(e)]
        return hits[0] if hits else None

    return jax.tree.map(dim, specs, is_leaf=is_spec)


def fsdp_axes(specs) -> str | tuple[str, ...]:
    """The axes the FSDP-sharded leaves of ``specs`` are split over (one entry for all of them): ``"data"``, or
    ``("replica", "data")`` for fsdp on a hybrid mesh. ConfigError where leaves differ (a per-device strategy
    reduces over one set)."""
    found = {tuple(a for a in axes_of(e) if a in BATCH_AXES) for spec in jax.tree.leaves(specs, is_leaf=is_spec)
             for e in spec if DATA_AXIS in axes_of(e)}
    if len(found) > 1:
        raise ConfigError(f"parameters sharded over different batch axes ({', '.join(map(str, sorted(found)))}): "
                          "shard_map, ring and accumulation reduce over one set; use one kind of FSDP rule")
    return _entry(found.pop()) if found else DATA_AXIS


def describe(specs) -> dict:
    """``{"sharded": {name: spec}, "replicated": [names]}``: what the summary records."""
    sharded, replicated = {}, []
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    for path, spec in flat:
        if any(e is not None for e in spec):
            sharded[path_name(path)] = str(spec)
        else:
            replicated.append(path_name(path))
    return {"sharded": sharded, "replicated": replicated}


def state_specs(state_shapes, pspecs, tx: optax.GradientTransformation, frozen_specs=None, opt_specs=None):
    """PartitionSpecs for a whole TrainState: optimizer state follows its parameter (or ``opt_specs``, per
    parameter: ZeRO-1's); ``Frozen`` model state gets ``frozen_specs(tree)`` (the parameters' rules; default
    replicated); the rest replicated."""

    def replicated(tree):
        return jax.tree.map(lambda _: P(), tree)

    frozen_specs = frozen_specs or replicated
    with jax.transfer_guard("allow"):  # tree_map_params runs tx.init eagerly (inject_hyperparams makes arrays)
        opt = optax.tree_map_params(tx, lambda _, spec: spec, state_shapes.opt_state,
                                    pspecs if opt_specs is None else opt_specs,
                                    transform_non_params=lambda _: P(), is_leaf=is_spec)
    model_state = jax.tree.map(lambda x: Frozen(frozen_specs(x.tree)) if is_frozen(x) else P(),
                               state_shapes.model_state, is_leaf=is_frozen)
    return state_shapes.replace(step=P(), params=pspecs, opt_state=opt, model_state=model_state, rng=P(),
                                loss_scale=replicated(state_shapes.loss_scale))


def device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays that ONE device holds (its shard of each; all of a replicated one)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def place(tree, shardings):
    """Every leaf as a NEW global array with its sharding (``shardings``: one, or a tree like ``tree``).

    Built from host values with ``make_array_from_callback``, so it works in
    multi-process runs (every process holds the same values) and never
    aliases the caller's arrays (``device_put`` may, and the step donates).
    """

    def put(x, sharding):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys: place their data
            return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    if isinstance(shardings, NamedSharding):
        return jax.tree.map(lambda x: put(x, shardings), tree)
    return jax.tree.map(put, tree, shardings)


def is_abstract(tree) -> bool:
    """Every leaf a ``jax.ShapeDtypeStruct`` (shapes to compile for, no arrays)."""
    return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def abstract(tree, shardings):
    """Every leaf as a ``jax.ShapeDtypeStruct`` with its sharding (``shardings``: one, or a tree like ``tree``):
    what a step compiles for without any array existing."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
