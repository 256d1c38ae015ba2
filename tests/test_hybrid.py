"""Hybrid meshes (replica x data): the batch over both, hsdp sharded within a replica; every layout equals the
1-device reference, and only hsdp's shards cross the replica (process) boundary. One process stands in for
two here (the replica index is the process: diagnostics.replica_hosts); tests/test_distributed.py runs it on two.
"""

import jax
import optax
import pytest
from conftest import random_batch
from reference import reference_runs
from tolerance import assert_state_reassociated
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.analysis.diagnostics import collective_bytes, crossing_bytes, replica_hosts
from jaxtrain.models import lenet

HYBRID = {"replica": 2, "data": 2}
BATCHES = [random_batch(32, seed=s) for s in range(3)]
SHARDED = ("conv2", "dense1", "dense2")  # the leaves over min_size: what fsdp and hsdp shard


def init_params():
    return lenet.init_params(jax.random.key(0), scale=0.1)


def train(strategy, param_sharding, accum_steps=1):
    trainer = jt.make_train_step(lenet.loss_fn, optax.adam(1e-3, eps=1e-6), mesh=jt.make_mesh(4, HYBRID),
                                 strategy=strategy, param_sharding=param_sharding, accum_steps=accum_steps)
    state, history = trainer.init(init_params()), []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return trainer, state, history


CASES = [(s, p, 1) for s in ("jit", "explicit", "shard_map") for p in ("replicated", "fsdp", "hsdp")] + \
    [(s, "hsdp", 2) for s in ("jit", "explicit", "shard_map")] + [("shard_map", "fsdp", 2), ("shard_map", "zero1", 1)]


@pytest.mark.parametrize(("strategy", "param_sharding", "accum_steps"), CASES)
def test_every_layout_on_a_hybrid_mesh_equals_the_reference(strategy, param_sharding, accum_steps):
    trainer, state, history = train(strategy, param_sharding, accum_steps)
    reference = reference_runs(lenet.loss_fn, lambda: optax.adam(1e-3, eps=1e-6), init_params(), BATCHES,
                               accum_steps=accum_steps)
    assert_state_reassociated(jax.device_get(state), history, *reference)
    assert trainer.batch_plan.batch.spec == P(("replica", "data")) and trainer.batch_plan.data_shards == 4
    w, mu = state.params["dense1"]["w"], state.opt_state[0].mu["dense1"]["w"]
    held = {"replicated": (1, 1), "zero1": (1, 1 / 4), "fsdp": (1 / 4, 1 / 4), "hsdp": (1 / 2, 1 / 2)}
    assert (w.addressable_shards[0].data.size / w.size, mu.addressable_shards[0].data.size / mu.size) == \
        held[param_sharding]
    if param_sharding == "hsdp":
        assert w.sharding.spec == P("data", None)  # split within a replica, whole across


def crossing(param_sharding):
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(4, HYBRID),
                                 strategy="shard_map", param_sharding=param_sharding)
    state = trainer.init(init_params())
    text = trainer.lower(state, BATCHES[0]).compile().as_text()
    return crossing_bytes(text, replica_hosts(trainer.mesh)), collective_bytes(text)


def test_only_hsdps_gradient_shards_cross_the_replica_boundary():
    """Per step, what crosses processes (bytes of the collectives whose groups span replicas), against theory:
    replicated all-reduces every gradient G across; fsdp all-gathers and reduce-scatters its sharded S across
    too; hsdp reduce-scatters and all-gathers within, and all-reduces only its 1/2 shard of S across."""
    params = init_params()
    grads = 4 * sum(x.size for x in jax.tree.leaves(params))
    sharded = 4 * sum(params[k]["w"].size for k in SHARDED)
    scalars = 4 * 3  # the loss, the accuracy and the share of labels out of range
    assert replica_hosts(jt.make_mesh(4, HYBRID)) == [0, 0, 1, 1]
    across, _ = crossing("replicated")
    assert across == {"all-reduce": {"ops": 1, "bytes": grads + scalars}}
    across, _ = crossing("fsdp")
    assert across["all-gather"]["bytes"] == across["reduce-scatter"]["bytes"] == sharded
    across, every = crossing("hsdp")
    assert set(across) == {"all-reduce"} and across["all-reduce"]["bytes"] == sharded // 2 + grads - sharded + scalars
    assert every["all-gather"]["bytes"] == every["reduce-scatter"]["bytes"] == sharded  # within a replica


def test_hybrid_mesh_order_and_the_strategies_that_refuse_it():
    mesh = jt.make_mesh(4, {"data": 2, "replica": 2})
    assert mesh.axis_names == ("replica", "data")  # the outer axis, whatever order it is given in
    with pytest.raises(jt.ConfigError, match="ring runs over one axis"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=mesh, strategy="ring").init(init_params())
    with pytest.raises(jt.ConfigError, match="keeps the whole state on every device of a 1-D mesh"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=mesh, strategy="pmap").init(init_params())
    with pytest.raises(jt.ConfigError, match="'data' and 'stage' only"):
        jt.make_pipeline_step(lambda p, x: x, lambda p, x: x, lambda p, x, b: (0.0, {}), optax.sgd(0.1),
                              mesh=jt.make_mesh(4, {"replica": 2, "stage": 2, "data": 1}), microbatches=2)


def test_the_bench_hybrid_command_prints_the_table_and_writes_json(capsys, tmp_path):
    import json

    from experiments import bench_hybrid

    assert bench_hybrid.main(["--json", str(tmp_path / "h.json")]) == 0
    out = capsys.readouterr().out
    assert "hsdp / replicated bytes across processes: 0.502 measured, 0.502 in theory" in out
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert set(rows) == {"replicated", "fsdp", "zero1", "hsdp"}
    for row in rows.values():  # the compiled program's bytes across, kind by kind, are the theory's
        assert {k: v["bytes"] for k, v in row["across"].items()} == row["theory"]
