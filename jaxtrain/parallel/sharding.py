"""Where the batch and the training state live on the mesh: written once, used by every strategy.

- The batch: sharded over ``"data"`` (its leading axis; a hybrid mesh: over
  ``("replica", "data")``), replicated over every other mesh axis
  (``placement.Plan``, which holds all of a step's placement).
- The parameters: by ``param_sharding``'s rules (``rules.ParamSharding``: a
  PartitionSpec per parameter).
- The optimizer state follows its parameter (``optax.tree_map_params`` over
  ``jax.eval_shape(tx.init, ...)``); ``Frozen`` model state (a distillation
  teacher's weights) is placed by the same rules as the parameters; step,
  rng, loss scale and the rest of the model state (e.g. BatchNorm
  statistics) are replicated (``state_specs``).
- ``place``: host values onto any sharding, as new global arrays.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.core.state import Frozen, is_frozen
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.devices import DATA_AXIS, REPLICA_AXIS

BATCH_AXES = (REPLICA_AXIS, DATA_AXIS)  # what the batch may be split over (devices.batch_axes): FSDP's axes too


def is_spec(x) -> bool:
    return isinstance(x, P)


def axes_of(entry) -> tuple:
    """The mesh axes one PartitionSpec entry names: None -> (), "data" -> ("data",), ("data", "model") as is."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: tuple):
    """One PartitionSpec entry for these mesh axes (``axes_of``'s inverse)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def data_only(spec: P) -> P:
    """``spec`` with only its batch axes ("data", "replica": what a shard_map manual over them alone sees)."""
    return P(*(spec_entry(tuple(a for a in axes_of(e) if a in BATCH_AXES)) for e in spec))


def without_data(spec: P) -> P:
    """``spec`` gathered over the batch axes: its other axes (e.g. "model") kept."""
    return P(*(spec_entry(tuple(a for a in axes_of(e) if a not in BATCH_AXES)) for e in spec))


def path_name(path) -> str:
    """``("dense1", "w")`` -> ``"dense1/w"``: what rules match."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


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
    return spec_entry(found.pop()) if found else DATA_AXIS


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


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def state_specs(state_shapes, pspecs, tx: optax.GradientTransformation, frozen_specs=None, opt_specs=None):
    """PartitionSpecs for a whole TrainState: optimizer state follows its parameter (or ``opt_specs``, per
    parameter: ZeRO-1's); ``Frozen`` model state gets ``frozen_specs(tree)`` (the parameters' rules; default
    replicated); the rest replicated."""

    def replicated(tree):
        return jax.tree.map(lambda _: P(), tree)

    frozen_specs = frozen_specs or replicated
    with jax.transfer_guard("allow"):  # tree_map_params runs tx.init eagerly (inject_hyperparams makes arrays)
        # a masked state (optax.multi_transform / masked: fine-tuning's groups) keeps its MaskedNode placeholders
        opt = optax.tree_map_params(tx, lambda value, spec: value if _masked(value) else spec, state_shapes.opt_state,
                                    pspecs if opt_specs is None else opt_specs,
                                    transform_non_params=lambda _: P(), is_leaf=lambda x: is_spec(x) or _masked(x))
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
