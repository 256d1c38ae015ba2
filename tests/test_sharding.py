"""Sharded state (FSDP, tensor parallelism, both on a 2-D mesh): every combination equals the 1-device step."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_batch
from reference import Reference, assert_matches, float64_steps
from tolerance import assert_reassociated, assert_state_reassociated, assert_sums_reassociated
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.models import lenet
from jaxtrain.parallel.sharding import device_bytes

BATCHES = [random_batch(64, seed=s) for s in range(3)]
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.2), "adam": lambda: optax.adam(1e-3, eps=1e-6),  # eps: see test_step
              "momentum": lambda: optax.sgd(0.2, momentum=0.9)}  # an optimizer state that is not scale-invariant
TP = [(r"dense1/w$", P(None, "model")), (r"dense1/b$", P("model")), (r"dense2/w$", P("model", None))]
FSDP_TP = [(r"dense1/w$", jt.FSDP(P(None, "model"))), (r"dense1/b$", P("model")),
           (r"dense2/w$", jt.FSDP(P("model", None))), (".*", "fsdp")]
# bf16/fp16 runs against a same-precision reference (fp32 ones: the policy of tests/tolerance.py): they matched
# it bit for bit here; 1e-5 is 1000x below an update of SGD + momentum at lr 0.2 (~1e-2).
LOW_PRECISION_TOL = {"rtol": 1e-5, "atol": 1e-5}

PARAMS, KEY = lenet.init_params(jax.random.key(0)), jax.random.key(0)  # made before the compile checks below


def init_params():
    return lenet.init_params(jax.random.key(0), scale=0.1)


def train(opt="sgd", mesh=1, loss_fn=lenet.loss_fn, **kw):
    trainer = jt.make_train_step(loss_fn, OPTIMIZERS[opt](), mesh=mesh, **kw)
    state = trainer.init(init_params())
    history = []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return trainer, state, history


MODES = {"bf16": {"precision": "bf16"}, "fp16": {"precision": "fp16"}, "accum4": {"accum_steps": 4}, "fp32": {}}


@functools.cache
def reference_for(opt: str, mode: str = "fp32"):
    """jaxtrain's 1-device run (no remat: remat must not change the numbers), held to the independent reference;
    in fp32 also the same steps in float64 (tests/tolerance.py)."""
    _, state, history = train(opt, 1, **MODES[mode])
    exact = assert_matches(state, history, lenet.loss_fn, OPTIMIZERS[opt](), init_params(), BATCHES, **MODES[mode])
    return (state, history) if exact is None else (state, history, exact)


@functools.cache
def per_device_reference(mode: str):
    """What 4 data-parallel devices compute by definition in a low precision (tests/reference.py, devices=4).

    In bf16/fp16 the gradient of each device's share is rounded to the compute
    dtype before the fp32 mean over devices, so 4 devices legitimately differ
    from 1 (LeNet's conv1 bias gradient, a sum of ~40k bf16 terms, by ~20% per
    step here): the same-precision 1-device run is no tight reference, this is.
    """
    ref = Reference(lenet.loss_fn, OPTIMIZERS["momentum"](), init_params(), precision=mode, devices=4)
    history = [ref.step(batch) for batch in BATCHES]
    scale = None if ref.loss_scale is None else {"scale": ref.loss_scale.scale, "good_steps": ref.loss_scale.good}
    return jt.TrainState(step=ref.step_count, params=ref.params, opt_state=ref.opt_state, model_state={},
                         rng=None, loss_scale=scale), history


@pytest.fixture(scope="module")
def reference():
    return {opt: reference_for(opt) for opt in ("sgd", "adam")}


def assert_equal_to(reference, state, history):
    """By the tolerance policy where ``reference`` carries its float64 run; else within LOW_PRECISION_TOL."""
    ref_state, ref_history, *exact = reference
    host = jax.device_get(state)
    assert int(host.step) == int(ref_state.step) == len(BATCHES)
    assert not np.allclose(host.params["dense1"]["w"], jax.device_get(init_params())["dense1"]["w"])
    if exact:
        assert_state_reassociated(host, history, jax.device_get(ref_state), ref_history, *exact)
        return
    tol = LOW_PRECISION_TOL
    chex.assert_trees_all_close(host.params, jax.device_get(ref_state.params), **tol)
    chex.assert_trees_all_close(host.opt_state, jax.device_get(ref_state.opt_state), **tol)
    chex.assert_trees_all_close(host.loss_scale, jax.device_get(ref_state.loss_scale), **tol)
    chex.assert_trees_all_close([{k: m[k] for k in r} for m, r in zip(history, ref_history)], ref_history, **tol)


def shard_fraction(x) -> float:
    return x.addressable_shards[0].data.size / x.size


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("strategy", ["jit", "explicit", "shard_map", "ring"])
def test_fsdp_equals_one_device_reference(reference, strategy, n, opt):
    trainer, state, history = train(opt, n, strategy=strategy, param_sharding="fsdp")
    assert_equal_to(reference[opt], state, history)
    # Really sharded: each device holds 1/n of every big parameter and of its optimizer state.
    w = state.params["dense1"]["w"]  # (800, 128): the larger dimension is split
    assert w.sharding.spec == P(jt.DATA_AXIS, None) and shard_fraction(w) == 1 / n
    # conv2/w (5, 5, 20, 50): 50 output channels split 2 ways; 4 ways only the 20 input channels divide
    assert state.params["conv2"]["w"].sharding.spec == (P(None, None, None, jt.DATA_AXIS) if n == 2
                                                        else P(None, None, jt.DATA_AXIS, None))
    assert shard_fraction(state.params["conv1"]["w"]) == 1  # 180 elements < min_size: replicated
    if opt == "adam":
        mu = state.opt_state[0].mu["dense1"]["w"]
        assert mu.sharding.spec == w.sharding.spec and shard_fraction(mu) == 1 / n
    layout = trainer.layout(state.params)
    assert "dense1/w" in layout["sharded"] and "conv1/w" in layout["replicated"]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("rules", ["tp", "fsdp+tp"])
@pytest.mark.parametrize("strategy", ["jit", "explicit"])
def test_tensor_parallel_and_2d_fsdp_on_a_2x2_mesh_equal_the_reference(reference, strategy, rules, opt):
    mesh = jt.make_mesh(4, axes={"data": 2, "model": 2})
    _, state, history = train(opt, mesh, strategy=strategy, param_sharding=TP if rules == "tp" else FSDP_TP)
    assert_equal_to(reference[opt], state, history)
    w1, w2 = state.params["dense1"]["w"], state.params["dense2"]["w"]
    if rules == "tp":
        assert w1.sharding.spec == P(None, "model") and shard_fraction(w1) == 1 / 2
    else:
        assert w1.sharding.spec == P("data", "model") and shard_fraction(w1) == 1 / 4
        assert w2.sharding.spec == P("model", None) or shard_fraction(w2) <= 1 / 2
    assert shard_fraction(w2) <= 1 / 2


@pytest.mark.parametrize("strategy", ["jit", "explicit", "shard_map", "ring"])
@pytest.mark.parametrize("mode", ["bf16", "fp16", "accum4", "remat"])
def test_fsdp_composes_with_precision_accumulation_and_remat(strategy, mode):
    """SGD + momentum at lr 0.2 for 3 steps: one update moves the parameters by ~1e-2, far above the tolerance,
    so a skipped or doubled one fails.

    fp32 (accumulation, remat) against the 1-device run. bf16/fp16 under
    shard_map and ring (fp32 mean of the per-device gradients) against the
    4-device reference, which they matched bit for bit here; under jit XLA
    chooses where partial sums are rounded, so jit x fsdp is held to jit's
    own data-parallel run on the same 4 devices (bit-identical here; explicit,
    whose model runs under GSPMD too, likewise).
    """
    kw = {"loss_fn": lenet.make_loss_fn("full")} if mode == "remat" else MODES[mode]
    _, state, history = train("momentum", 4, strategy=strategy, param_sharding="fsdp", **kw)
    if mode in ("accum4", "remat"):
        reference = reference_for("momentum", "fp32" if mode == "remat" else mode)
    elif strategy in ("jit", "explicit"):
        reference = train("momentum", 4, strategy=strategy, **kw)[1:]
    else:
        reference = per_device_reference(mode)
    assert_equal_to(reference, state, history)
    if mode == "fp16":  # the loss scale was exercised: overflow skips, then updates
        finite = [float(m["grads_finite"]) for m in history]
        assert 1.0 in finite, finite


@pytest.mark.parametrize("strategy", ["jit", "explicit"])
def test_fsdp_tp_composes_with_accumulation(strategy):
    mesh = jt.make_mesh(4, axes={"data": 2, "model": 2})
    _, state, history = train("momentum", mesh, strategy=strategy, param_sharding=FSDP_TP, accum_steps=4)
    assert_equal_to(reference_for("momentum", "accum4"), state, history)


def test_fsdp_with_optax_multisteps_keeps_its_accumulator_sharded():
    _, ref_state, ref_history = train("adam", 1, accum_steps=3, accum="multisteps")
    exact = assert_matches(ref_state, ref_history, lenet.loss_fn, OPTIMIZERS["adam"](), init_params(), BATCHES,
                           accum_steps=3, accum="multisteps")
    _, state, history = train("adam", 4, strategy="shard_map", param_sharding="fsdp", accum_steps=3,
                              accum="multisteps")
    host, ref_host = jax.device_get((state, ref_state))
    assert_state_reassociated(host.replace(opt_state=host.opt_state.inner_opt_state), history,
                              ref_host.replace(opt_state=ref_host.opt_state.inner_opt_state), ref_history, exact)
    acc = state.opt_state.acc_grads["dense1"]["w"]
    assert acc.sharding.spec == P(jt.DATA_AXIS, None) and shard_fraction(acc) == 1 / 4


def test_init_fn_builds_the_sharded_state_in_place():
    trainer = jt.make_train_step(lenet.loss_fn, optax.adam(1e-3), mesh=4, param_sharding="fsdp")
    rng = jax.random.key(3)

    def init_fn(r):
        return lenet.init_params(r), {}

    direct = trainer.init(*jax.jit(init_fn)(rng), rng=rng)  # compiled, as init_fn is (eager differs by 1 ulp)
    built = trainer.init(init_fn=init_fn, rng=rng)
    chex.assert_trees_all_equal(jax.device_get(built.params), jax.device_get(direct.params))
    chex.assert_trees_all_equal(jax.device_get(built.opt_state), jax.device_get(direct.opt_state))
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(direct)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert shard_fraction(built.params["dense1"]["w"]) == 1 / 4
    with pytest.raises(jt.ConfigError, match="params .* or init_fn"):
        trainer.init()


def run_collectives(mesh, tree, dims):
    """(lax result, ring result) of reduce-scatter and all-gather on per-device values stacked on axis 0."""
    n = mesh.shape[jt.DATA_AXIS]
    specs = jax.tree.map(lambda _: P(jt.DATA_AXIS), tree)

    def f(t):
        t = jax.tree.map(lambda x: x[0], t)  # this device's value
        lax_rs = jax.tree.map(lambda x, d: lax.psum_scatter(x, jt.DATA_AXIS, scatter_dimension=d, tiled=True), t, dims)
        lax_ag = jax.tree.map(lambda x, d: lax.all_gather(x, jt.DATA_AXIS, axis=d, tiled=True), lax_rs, dims)
        ring_rs = jt.ring_reduce_scatter(t, jt.DATA_AXIS, dims)
        ring_ag = jt.ring_all_gather(ring_rs, jt.DATA_AXIS, dims)
        return jax.tree.map(lambda x: x[None], (lax_rs, ring_rs, lax_ag, ring_ag))

    out = jax.shard_map(f, mesh=mesh, in_specs=(specs,), out_specs=P(jt.DATA_AXIS), check_vma=False)
    return jax.device_get(jax.jit(out)(tree)), n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_reduce_scatter_and_all_gather_equal_lax(n):
    mesh = jt.make_mesh(jax.devices()[:n])
    rng = np.random.default_rng(n)
    # The scattered dimension divides by n; the others do not (and sizes overall do not).
    shapes = {"a": ((n * 3,), 0), "b": ((5, n * 2, 7), 1), "c": ((n, 3), 0), "d": ((7, n), 1)}
    tree = {k: jnp.asarray(rng.normal(size=(n, *s)), jnp.float32) for k, (s, _) in shapes.items()}
    tree["e"] = jnp.asarray(rng.integers(-5, 5, (n, n * 2, 3)), jnp.int32)  # mixed dtypes in one call
    dims = {**{k: d for k, (_, d) in shapes.items()}, "e": 0}
    (lax_rs, ring_rs, lax_ag, ring_ag), n = run_collectives(mesh, tree, dims)
    assert_sums_reassociated(ring_rs, lax_rs, tree, "reduce-scatter")  # a ring adds in another order than lax
    assert_sums_reassociated(ring_ag, lax_ag, tree, "all-gather")  # (it gathers those sums)
    # ... and right, not merely equal to lax: device i holds block i of the sum; everyone holds the whole sum.
    total = np.asarray(tree["b"]).sum(0)
    for i in range(n):
        np.testing.assert_allclose(ring_rs["b"][i], total[:, 2 * i : 2 * i + 2], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ring_ag["b"][i], total, rtol=1e-6, atol=1e-6)


def collectives(trainer, state, batch=BATCHES[0]):
    return jt.compiled_stats(trainer, state, batch, residuals=False)["collectives"]


@pytest.mark.parametrize("strategy", ["jit", "explicit", "shard_map", "ring"])
def test_gradients_reduce_scattered_once_per_update_with_accumulation(strategy):
    """k=4 micro-batches move exactly what k=1 moves (CPU unrolls the scan: a reduction inside it would count 4x)."""
    stats = {}
    for k in (1, 4):
        trainer = jt.make_train_step(lenet.loss_fn, optax.adam(1e-3), mesh=4, strategy=strategy,
                                     param_sharding="fsdp", accum_steps=k)
        stats[k] = collectives(trainer, trainer.init(init_params()))
    sharded = 3  # conv2/w, dense1/w, dense2/w (the rest is under min_size)
    if strategy == "ring":
        assert stats[4] == stats[1] and set(stats[4]) == {"collective-permute"}
    else:
        assert stats[4]["reduce-scatter"]["ops"] == sharded
        assert stats[4]["all-gather"]["ops"] == sharded  # each parameter gathered once, before the loop
        params_bytes = 4 * sum(init_params()[k]["w"].size for k in ("conv2", "dense1", "dense2"))
        assert stats[4]["reduce-scatter"]["bytes"] == stats[4]["all-gather"]["bytes"] == params_bytes
    if strategy == "shard_map":
        assert stats[4] == stats[1]


def test_collective_bytes_match_the_theory_for_data_parallel_and_fsdp():
    params = init_params()
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    dp = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, strategy="shard_map")
    fsdp = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, strategy="shard_map", param_sharding="fsdp")
    got_dp, got_fsdp = collectives(dp, dp.init(params)), collectives(fsdp, fsdp.init(params))
    scalars = 4 * 3  # the loss, the accuracy and the share of labels out of range are averaged too
    assert got_dp == {"all-reduce": {"ops": 1, "bytes": grad_bytes + scalars}}  # XLA combines them into one
    sharded = 4 * sum(params[k]["w"].size for k in ("conv2", "dense1", "dense2"))
    assert got_fsdp["all-gather"]["bytes"] == got_fsdp["reduce-scatter"]["bytes"] == sharded
    assert got_fsdp["all-reduce"]["bytes"] == grad_bytes - sharded + scalars


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("strategy", ["jit", "explicit", "shard_map", "ring"])
def test_zero1_shards_only_the_optimizer_state_and_equals_the_reference(reference, strategy, opt):
    trainer, state, history = train(opt, 4, strategy=strategy, param_sharding="zero1")
    assert_equal_to(reference[opt], state, history)
    w = state.params["dense1"]["w"]
    assert shard_fraction(w) == 1 and all(shard_fraction(p) == 1 for p in jax.tree.leaves(state.params))
    if opt == "adam":
        mu, nu = state.opt_state[0].mu["dense1"]["w"], state.opt_state[0].nu["conv2"]["w"]
        assert mu.sharding.spec == P(jt.DATA_AXIS, None) and shard_fraction(mu) == shard_fraction(nu) == 1 / 4
    assert trainer.layout(state.params)["sharded"] == {}  # the parameters: all replicated


def test_zero1_reduce_scatters_the_gradients_and_all_gathers_the_new_params_one_all_reduce_of_bytes():
    """ZeRO-1's (and ZeRO-2's) traffic: each sharded gradient reduce-scattered and its new parameter all-gathered,
    together the bytes of one all-reduce of it; the small replicated leaves all-reduced as before."""
    params = init_params()
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    zero1 = jt.make_train_step(lenet.loss_fn, optax.adam(1e-3), mesh=4, strategy="shard_map", param_sharding="zero1")
    state = zero1.init(params)
    got = collectives(zero1, state)
    sharded = 4 * sum(params[k]["w"].size for k in ("conv2", "dense1", "dense2"))
    assert got["reduce-scatter"]["bytes"] == got["all-gather"]["bytes"] == sharded
    assert got["all-reduce"]["bytes"] == grad_bytes - sharded + 4 * 3  # + the loss, accuracy, labels out of range
    held = {name: device_bytes(getattr(state, name)) for name in ("params", "opt_state")}
    assert held["params"] == grad_bytes and held["opt_state"] < 2 * grad_bytes / 4 + 2 * (grad_bytes - sharded)


def test_hlo_collective_parser_reads_every_replica_group_format():
    from jaxtrain.analysis.diagnostics import collective_bytes

    hlo = """
  %a = f32[8,4]{1,0} all-gather(%p), replica_groups={{0,1},{2,3}}, dimensions={0}
  %b = f32[2,4]{1,0} reduce-scatter(%q), replica_groups=[1,4]<=[4], dimensions={0}
  %c = bf16[2,4]{1,0} reduce-scatter(%q), replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, dimensions={0}
  ROOT %d = (f32[20]{0}, /*index=1*/s32[]) all-reduce(%x, %y), replica_groups={{0,1,2,3}}
  %e = f32[16]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}
"""
    assert collective_bytes(hlo) == {
        "all-gather": {"ops": 1, "bytes": 128},
        "reduce-scatter": {"ops": 2, "bytes": 32 * 4 + 16 * 2},
        "all-reduce": {"ops": 1, "bytes": 84},
        "collective-permute": {"ops": 1, "bytes": 64},
    }


@pytest.mark.parametrize(("make", "says"), [
    (lambda: jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, strategy="pmap",
                                param_sharding="fsdp").init(PARAMS, rng=KEY),
     "'pmap' keeps the whole state.*use strategy='jit'"),
    (lambda: jt.make_mesh(4, axes={"data": 3, "model": 2}), "6 places but there are 4 devices"),
    (lambda: jt.make_mesh(4, axes={"model": 3}), "no 'data' axis"),  # 3 does not leave "data" a whole count
    (lambda: jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, param_sharding=TP).init(PARAMS, rng=KEY),
     r"dense1/\w: PartitionSpec.*names axis 'model' but the mesh has only data"),
    (lambda: jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(4, axes={"data": 1, "model": 4}),
                                param_sharding=[("dense2/w", P(None, "model"))]).init(PARAMS, rng=KEY),
     r"dense2/w \(128, 10\).*splits a dimension of 10 4 ways"),
    (lambda: jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=jt.make_mesh(4, axes={"data": 2, "model": 2}),
                                strategy="shard_map", param_sharding=TP).init(PARAMS, rng=KEY),
     "'shard_map' shards parameters over 'data' only.*use strategy='jit'"),
    (lambda: jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, param_sharding="zero3"),
     "param_sharding 'zero3'"),
    (lambda: jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, strategy="pmap",
                                param_sharding="zero1").init(PARAMS, rng=KEY),
     "'pmap' keeps the whole state.*use strategy='jit'"),
    (lambda: jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, param_sharding=[("dense(", "fsdp")]),
     "not a regular expression"),
])
def test_bad_combinations_are_one_line_errors_before_compiling(make, says, caplog):
    with jax.log_compiles(), pytest.raises(jt.ConfigError, match=says) as err:
        make()
    assert "\n" not in str(err.value)
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]


@pytest.mark.parametrize(("saved", "restored"), [
    ((4, None, "fsdp"), (2, None, "replicated")),
    ((4, {"data": 2, "model": 2}, TP), (4, None, "fsdp")),
    ((2, None, "replicated"), (4, {"data": 2, "model": 2}, FSDP_TP)),
])
def test_checkpoint_restores_bit_identically_onto_another_mesh_and_sharding(tmp_path, saved, restored):
    from jaxtrain.train.checkpoint import Checkpointer
    from jaxtrain.train.loop import Position

    def trainer_for(n, axes, param_sharding):
        return jt.make_train_step(lenet.loss_fn, optax.adam(1e-3), mesh=jt.make_mesh(n, axes=axes),
                                  param_sharding=param_sharding)

    first = trainer_for(*saved)
    state = first.init(init_params())
    for batch in BATCHES[:2]:
        state, _ = first(state, batch)
    ck = Checkpointer(tmp_path / "ck", keep=2)
    ck.save(state, Position(total_steps=2), wait=True)
    ck.close()

    second = trainer_for(*restored)
    like = second.init(init_params())
    ck = Checkpointer(tmp_path / "ck", keep=2)
    got = ck.restore(like)
    ck.close()
    chex.assert_trees_all_equal(jax.device_get(got.state.params), jax.device_get(state.params))
    chex.assert_trees_all_equal(jax.device_get(got.state.opt_state), jax.device_get(state.opt_state))
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(like)):  # placed the NEW way
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    # ... and training goes on from there as it would have on the first mesh: the third step on either mesh is
    # the same computation re-associated, held to the float64 run of all three (the policy, tests/tolerance.py).
    after, metrics = second(got.state, BATCHES[2])
    expected, expected_metrics = first(state, BATCHES[2])
    exact = float64_steps(lenet.loss_fn, optax.adam(1e-3), init_params(), BATCHES)
    assert_reassociated(after.params, expected.params, exact.params, "params", exact.start_params)
    zeros = jax.tree.map(np.zeros_like, exact.opt_state)
    assert_reassociated(after.opt_state, expected.opt_state, exact.opt_state, "opt_state", zeros)
    keep = list(exact.history[-1])
    assert_reassociated(*({k: m[k] for k in keep} for m in (metrics, expected_metrics, exact.history[-1])),
                        "metrics", exact.history[0])


def test_a_mesh_without_data_gives_it_the_devices_the_other_axes_leave():
    assert dict(jt.make_mesh(4, axes={"stage": 2}).shape) == {"data": 2, "stage": 2}
    assert list(jt.make_mesh(4, axes={"model": 4}).shape) == ["data", "model"]  # "data" first, size 1
