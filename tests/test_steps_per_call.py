"""K steps in one call (``Trainer.steps``): the same K steps as K single calls (docs/train-step.md, "Many steps
per call").

Bit for bit (``np.testing.assert_array_equal`` on every leaf of the state and on every step's metrics) where XLA
compiles the loop's body as it compiles one step: LeNet with oneDNN's fp32 convolutions under every strategy x
replicated / fsdp / zero1 on 2 devices (1 and 4 for some), scan and multisteps accumulation, remat. XLA's own
convolutions (bf16, fp16, ``conv="xla"``) are compiled another way in a loop's body: there ``unroll=True`` (the
K steps laid out straight) is bit for bit, and the loop is held to the suite's policies (tests/tolerance.py in
fp32; in bf16 / fp16 each step within one ulp of the compute dtype of a single call from the loop's own state, as
test_precision holds a sum in another order). A BatchNorm model and the pipelined trainer, whose fusions differ
by an ulp even unrolled, are held to the tolerance policy.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from conftest import random_batch, unavailable
from reference import float64_steps
from tolerance import assert_reassociated, assert_state_reassociated

import jaxtrain as jt
from jaxtrain import models
from jaxtrain.kernels import onednn
from jaxtrain.models import lenet
from jaxtrain.models.sequential import sequential_loss
from jaxtrain.train import pipeline

K = 3
BATCHES = [random_batch(8, seed=s) for s in range(K)]
SHARDINGS = ("replicated", "fsdp", "zero1")
FSDP_TP = [(r"dense1/w$", jt.FSDP(P(None, "model"))), (r"dense1/b$", P("model")), (r".*", "fsdp")]  # on data x model


@pytest.fixture(scope="module")
def onednn_lenet():
    """LeNet with oneDNN's fp32 convolutions (where the library is not usable: a skip; under CI on x86-64 Linux,
    where ``make test`` installs it, a failure)."""
    if not onednn.available():
        if os.environ.get("CI") == "true" and onednn.expected():
            pytest.fail(f"CI installs g++ and oneDNN, yet: {onednn.reason()}")
        unavailable(f"oneDNN convolutions not usable: {onednn.reason()}")
    return models.get("lenet", conv="onednn")


def lenet_params():
    return lenet.init_params(jax.random.key(0), scale=0.1)


def stacked(batches):
    """The steps' batches stacked on a leading axis: ``[K, batch, ...]``."""
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def single_calls(trainer, state, batches):
    """The state after one ``trainer(state, batch)`` per batch, and each call's metrics."""
    history = []
    for batch in batches:
        state, metrics = trainer(state, batch)
        history.append(metrics)
    return jax.device_get((state, history))


def one_call(trainer, state, batches, unroll=False):
    """The state after ``trainer.steps`` on the batches stacked, and its metrics as one dict per step."""
    state, metrics = jax.device_get(trainer.steps(state, stacked(batches), unroll=unroll))
    assert {np.shape(v) for v in metrics.values()} == {(len(batches),)}, metrics
    return state, [{k: v[i] for k, v in metrics.items()} for i in range(len(batches))]


def assert_bit_for_bit(got, want):
    """Every leaf of two (state, history) pairs equal, bit for bit (NaN where NaN)."""
    (state, history), (want_state, want_history) = got, want
    keyless = [s.replace(rng=jax.random.key_data(s.rng)) for s in (state, want_state)]
    paths = jax.tree_util.tree_flatten_with_path((keyless[1], want_history))[0]
    assert jax.tree.structure((keyless[0], history)) == jax.tree.structure((keyless[1], want_history))
    for (path, w), g in zip(paths, jax.tree.leaves((keyless[0], history))):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path), strict=True)


def check(model, strategy, n=2, unroll=False, batches=BATCHES, opt=lambda: optax.adam(1e-2), **kw):
    """K single calls and one call of K steps from the same fresh state: (theirs, ours). ``n``: devices, or a
    mesh's axes."""
    mesh = jt.make_mesh(int(np.prod(list(n.values()))), n) if isinstance(n, dict) else n
    trainer = jt.make_train_step(model.loss_fn, opt(), mesh=mesh, strategy=strategy, min_size=16, **kw)
    params = model.init(jax.random.key(0))[0]
    return single_calls(trainer, trainer.init(params), batches), one_call(trainer, trainer.init(params), batches,
                                                                          unroll)


CASES = [
    *[(s, 2, dict(param_sharding=p)) for s in jt.STRATEGIES for p in SHARDINGS if s != "pmap" or p == "replicated"],
    ("jit", 1, {}), ("shard_map", 4, dict(param_sharding="fsdp")), ("pmap", 4, {}),
    ("jit", 2, dict(accum_steps=2)), ("pmap", 2, dict(accum_steps=2)),
    ("shard_map", 2, dict(accum_steps=2, accum="multisteps")),
    ("ring", 2, dict(accum_steps=2, accum="multisteps", param_sharding="fsdp")),
    ("jit", 2, dict(remat="full")), ("shard_map", 2, dict(remat="dots", param_sharding="zero1")),
    ("explicit", {"data": 2, "model": 2}, dict(param_sharding=FSDP_TP)), ("shard_map", {"replica": 2, "data": 2}, {}),
]


@pytest.mark.parametrize("strategy, n, kw", CASES,
                         ids=[f"{s}-{n if isinstance(n, int) else 'x'.join(n)}-"
                              + ",".join(f"{k}={'rules' if isinstance(v, list) else v}" for k, v in kw.items())
                              for s, n, kw in CASES])
def test_k_steps_in_one_call_equal_k_single_calls_bit_for_bit(onednn_lenet, strategy, n, kw):
    """oneDNN's fp32 convolutions: the loop's body is compiled as one step is, the same bits (Adam: its moments
    too; multisteps: each of the K steps one micro-batch, an update every second)."""
    kw = dict(kw)  # the case's own: never the parametrization's
    model = models.get("lenet", conv="onednn", remat=kw.pop("remat")) if "remat" in kw else onednn_lenet
    theirs, ours = check(model, strategy, n, **kw)
    assert_bit_for_bit(ours, theirs)
    assert int(ours[0].step) == K


def relative_change(got, want, start) -> float:
    """How far ``got``'s parameters are from ``want``'s, norm-wise, relative to how far ``want``'s moved."""
    got, want, start = (np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(t)])
                        for t in (got, want, start))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want - start))


def loop_prefixes(trainer, batches):
    """For each step k of a K-step call: the loop's state before it and its (state, metrics) after it, the latter
    from a call on the first k batches (whose metrics are the K-step call's first k, bit for bit)."""
    whole = one_call(trainer, trainer.init(lenet_params()), batches)[1]
    before, out = jax.device_get(trainer.init(lenet_params())), []
    for k in range(1, len(batches) + 1):
        loop = one_call(trainer, trainer.init(lenet_params()), batches[:k])
        for got, want in zip(loop[1], whole[:k]):
            assert got.keys() == want.keys()
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name, strict=True)
        out.append((before, loop))
        before = loop[0]
    return out


def single_from(trainer, before, batch):
    """One call of ``trainer`` from a copy of the loop's state ``before`` (the call donates it), less what the
    trainer does not keep (fp32: no loss scale)."""
    start = jax.tree.map(lambda x: x.copy(), before if trainer.policy.loss_scale else before.replace(loss_scale=None))
    return single_calls(trainer, jax.device_put(start, trainer.plan(start).state), [batch])


@pytest.mark.parametrize("strategy, precision, kw", [
    ("jit", "fp32", {}), ("jit", "bf16", dict(accum_steps=2)), ("jit", "fp16", {}),
    ("shard_map", "fp32", dict(param_sharding="fsdp")), ("shard_map", "fp16", {}), ("pmap", "bf16", {}),
    ("explicit", "bf16", dict(param_sharding="zero1")),
])
def test_xla_convolutions_are_bit_for_bit_unrolled_and_within_the_policy_in_a_loop(strategy, precision, kw):
    """XLA's convolutions (``lenet.loss_fn``; bf16 and fp16 take XLA's in any model) are compiled another way in
    a loop's body (their fp32 sums re-associated): unrolled, the same bits. In the loop, fp32 by the tolerance
    policy (float64's steps the exact values). bf16 / fp16 round each gradient element to their precision after
    those sums, so an element may round one ulp the other way, and the next step starts from other low-precision
    values, which a step can amplify: at this learning rate the second step overshoots (the loss 2.33, then
    3.68), and fp16 under jit on jax 0.12 ends the K steps 1.8% of their move from the single calls (0.09% under
    shard_map; 0.001% on jax 0.10), after 0.02 ulp at the first step. So each of the K steps is held to one single
    call from the loop's own state before it: within one ulp of the compute dtype (test_precision's criterion for
    a sum in another order), its loss the same to an ulp, its step count and loss scale the same. A step computed
    in fp32 fails it (seen: 2.5 ulps and more)."""
    model = models.get("lenet", conv="xla")
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.2), mesh=2, strategy=strategy, precision=precision,
                                 min_size=16, **kw)
    theirs = single_calls(trainer, trainer.init(lenet_params()), BATCHES)
    assert_bit_for_bit(one_call(trainer, trainer.init(lenet_params()), BATCHES, unroll=True), theirs)
    assert_bit_for_bit(one_call(trainer, trainer.init(lenet_params()), BATCHES, unroll=None), theirs)  # auto
    if precision == "fp32":
        exact = float64_steps(model.loss_fn, optax.sgd(0.2), lenet_params(), BATCHES)  # any sharding's
        assert_state_reassociated(*one_call(trainer, trainer.init(lenet_params()), BATCHES), *theirs, exact)
        return
    ulp = float(jnp.finfo(trainer.policy.compute_dtype).eps)
    steps = loop_prefixes(trainer, BATCHES)
    for batch, (before, (ours, our_metrics)) in zip(BATCHES, steps):
        single, single_metrics = single_from(trainer, before, batch)
        assert relative_change(ours.params, single.params, before.params) <= ulp
        np.testing.assert_allclose(our_metrics[-1]["loss"], single_metrics[0]["loss"], rtol=ulp)
        counts = [jax.tree.leaves((state.step, state.loss_scale)) for state in (ours, single)]
        for got, want in zip(*counts, strict=True):
            np.testing.assert_array_equal(got, want, strict=True)
    fp32 = jt.make_train_step(model.loss_fn, optax.sgd(0.2), mesh=2, strategy=strategy, min_size=16, **kw)
    for batch, (before, (ours, _)) in zip(BATCHES, steps):
        single = single_from(fp32, before, batch)[0]
        assert relative_change(ours.params, single.params, before.params) > ulp  # a step in fp32 fails it


@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_a_batchnorm_model_is_within_the_tolerance_policy(strategy, unroll):
    """BatchNorm statistics in the model state (tests/test_batch_stats.py's net, XLA's convolutions): its
    running means' fusion rounds an ulp another way even unrolled, so both are held to the policy."""
    from test_batch_stats import adapter

    net = adapter()
    trainer = jt.make_train_step(net.loss_fn, optax.sgd(0.1), mesh=2, strategy=strategy)
    theirs = single_calls(trainer, trainer.init(net.params, net.model_state), BATCHES)
    ours = one_call(trainer, trainer.init(net.params, net.model_state), BATCHES, unroll)
    exact = float64_steps(net.loss_fn, optax.sgd(0.1), net.params, BATCHES, model_state=net.model_state)
    assert_state_reassociated(*ours, *theirs, exact)
    assert not np.array_equal(ours[0].model_state["bn1"]["mean"], net.model_state["bn1"]["mean"])


@pytest.mark.parametrize("axes, kw", [
    ({"data": 1, "stage": 2}, dict(microbatches=2)),
    ({"data": 2, "stage": 2}, dict(microbatches=4, schedule="circular", repeats=2)),
    ({"data": 1, "stage": 2}, dict(microbatches=2, remat="full")),
])
def test_the_pipelined_trainer_runs_k_steps_within_the_tolerance_policy(axes, kw):
    """``make_pipeline_step``'s trainer takes ``steps`` too: its schedule's scan inside the steps' loop; its
    matmuls fuse an ulp another way there (either layout), so it is held to the policy."""
    from test_pipeline_parallel import batches, embed_fn, head_loss_fn, init_fn, stage_fn

    mesh = jt.make_mesh(int(np.prod(list(axes.values()))), axes=axes)
    trainer = jt.make_pipeline_step(embed_fn, stage_fn, head_loss_fn, optax.adam(1e-2), mesh=mesh, **kw)
    data = batches()

    def fresh():
        return trainer.init(init_fn=init_fn, rng=jax.random.key(0))

    theirs, ours = single_calls(trainer, fresh(), data), one_call(trainer, fresh(), data)
    exact = float64_steps(sequential_loss(embed_fn, stage_fn, head_loss_fn), optax.adam(1e-2),
                          init_fn(jax.random.key(0)), data)
    got, want = ({**s.params, "stages": pipeline.layers(s.params["stages"])} for s in (ours[0], theirs[0]))
    assert_reassociated(got, want, exact.params, "params", exact.start_params)
    losses, want_losses, exact_losses = ([float(m["loss"]) for m in h] for h in (ours[1], theirs[1], exact.history))
    assert_reassociated(losses, want_losses, exact_losses, "losses", exact_losses[:1] * len(exact_losses))


def weighted_loss(params, model_state, batch, rng):
    """LeNet's loss times the batch's mean ``weight``: an infinite weight makes a step's loss non-finite."""
    loss, aux = lenet.loss_fn(params, model_state, {k: v for k, v in batch.items() if k != "weight"}, rng)
    return loss * batch["weight"].mean(), aux


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_non_finite_loss_shows_its_own_step_in_the_metrics(precision):
    """The third step's loss is infinite: it is the first non-finite one of the call's [K] metrics (fp32: the
    state is NaN from there on); fp16 skips that one update (``grads_finite`` 0, the loss scale halved after it)
    and the fourth step trains again. Unrolled (XLA's convolutions), the same bits as 4 single calls."""
    batches = [dict(random_batch(8, seed=s), weight=np.full(8, np.inf if s == 2 else 1, np.float32))
               for s in range(4)]
    model = models.get("lenet", conv="xla")
    model = type("Weighted", (), {"loss_fn": staticmethod(weighted_loss), "init": model.init})
    theirs, ours = check(model, "jit", unroll=True, batches=batches, opt=lambda: optax.sgd(0.2), precision=precision)
    assert_bit_for_bit(ours, theirs)
    loss = np.array([m["loss"] for m in ours[1]])
    if precision == "fp32":
        assert np.isfinite(loss[:2]).all() and not np.isfinite(loss[2:]).any(), loss
        assert not np.isfinite(ours[0].params["dense2"]["w"]).any()
    else:
        assert [float(m["grads_finite"]) for m in ours[1]] == [1, 1, 0, 1]
        scales = [float(m["loss_scale"]) for m in ours[1]]
        assert scales[3] == scales[2] / 2 and np.isfinite(loss[[0, 1, 3]]).all(), (scales, loss)
        assert np.isfinite(ours[0].params["dense2"]["w"]).all()


def test_labels_outside_the_classes_name_the_call_and_its_step():
    """The labels' check reads a call's [K] shares: the first call raises at once for its own second step;
    a later one when checked (here ``check_labels``; ``placed_steps`` checks as ``steps`` does)."""
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2)
    bad = [BATCHES[0], dict(BATCHES[1], label=np.where(np.arange(8) == 3, -1, BATCHES[1]["label"])), BATCHES[2]]
    top = bad[1]["label"].max()  # the range said is that step's labels'
    with pytest.raises(jt.ConfigError, match=rf"^12\.5% of the labels of the batch of call 1 \(its step 2 of 3\) "
                                             rf"are outside the model's classes \(they range -1\.\.{top}\).*consumed"):
        trainer.steps(trainer.init(lenet_params()), stacked(bad))
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2)
    state, _ = trainer.steps(trainer.init(lenet_params()), stacked(BATCHES))
    state, metrics = trainer.placed_steps(state, trainer.shard_steps(stacked(bad[::-1])))
    loss = np.asarray(metrics["loss"])
    assert np.isnan(loss[1]) and np.isfinite(loss[[0, 2]]).all()
    with pytest.raises(jt.ConfigError, match=r"^12\.5% of the labels of the batch of call 2 \(its step 2 of 3\)"):
        trainer.check_labels()


def test_compiled_once_per_k_checked_before_compiling_and_the_state_donated():
    traces = []

    def loss_fn(*args):
        traces.append(1)
        return lenet.loss_fn(*args)

    trainer = jt.make_train_step(loss_fn, optax.sgd(0.1), mesh=2)
    state = trainer.init(lenet_params())
    with pytest.raises(jt.ConfigError, match=r"needs the same leading \(steps\) axis, got sizes \[2, 3\]"):
        trainer.steps(state, {"image": stacked(BATCHES)["image"], "label": stacked(BATCHES[:2])["label"]})
    with pytest.raises(jt.ConfigError, match=r"batch size 7 does not split evenly over 2 devices"):
        trainer.steps(state, {k: v[:, :7] for k, v in stacked(BATCHES).items()})
    with pytest.raises(jt.ConfigError, match=r"needs a leading \(steps\) axis.*stack the steps' batches"):
        trainer.steps(state, {"image": BATCHES[0]["image"], "label": np.int32(0)})
    assert traces == []
    old = state
    state, _ = trainer.steps(state, stacked(BATCHES[:2]))
    assert old.params["conv1"]["w"].is_deleted(), "the state must be donated"
    state, _ = trainer.placed_steps(state, trainer.shard_steps(stacked(BATCHES[1:])))
    assert len(traces) == 1
    state, metrics = trainer.steps(state, stacked(BATCHES))
    assert len(traces) == 2 and metrics["loss"].shape == (3,) and int(state.step) == 7
    with pytest.raises(jt.ConfigError, match="donated to an earlier step"):
        trainer.steps(old, stacked(BATCHES))


@pytest.mark.parametrize("strategy", ["jit", "pmap"])
def test_lower_steps_from_shapes_lays_the_steps_out_straight_when_unrolled(strategy):
    """``lower_steps`` from shapes alone (``abstract_state``, ``[K, batch, ...]`` shapes), as ``lower``: a loop
    over the K steps, or none unrolled."""
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, strategy=strategy)
    state = trainer.abstract_state(lenet_params())
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stacked(BATCHES))
    looped = trainer.lower_steps(state, shapes, unroll=False).as_text()
    straight = trainer.lower_steps(state, shapes, unroll=True).as_text()
    assert "stablehlo.while" in looped and "stablehlo.while" not in straight
    assert trainer.lower_steps(state, shapes).compile() is not None
    assert "stablehlo.while" not in trainer.lower_steps(state, shapes, unroll=None).as_text()  # auto: a CPU's


FMA_PROBE = """
import jaxtrain as jt
jt.setup_devices(2)
import jax, jax.numpy as jnp, numpy as np, optax
def mlp_loss(params, model_state, batch, rng):  # test_calls' MLP: dense layers, no convolution
    logits = jnp.tanh(batch["image"].reshape(len(batch["image"]), -1) @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["label"], 10)).mean(), (model_state, {})
rng = np.random.default_rng(0)
batches = [{"image": rng.random((64, 12, 12, 1), dtype=np.float32),
            "label": rng.integers(0, 10, 64).astype(np.int32)} for _ in range(2)]
params = {"w1": jax.random.normal(jax.random.key(1), (144, 32)) * 0.1,
          "w2": jax.random.normal(jax.random.key(2), (32, 10)) * 0.1}
for name, tx, strategy in (("momentum", optax.sgd(0.1, momentum=0.9), "ring"), ("adam", optax.adam(1e-3), "shard_map")):
    trainer = jt.make_train_step(mlp_loss, tx, mesh=2, strategy=strategy)
    single = trainer.init(params)
    for b in batches:
        single, _ = trainer.step(single, b)
    straight, _ = trainer.steps(trainer.init(params), jax.tree.map(lambda *xs: np.stack(xs), *batches), unroll=True)
    leaves = [jax.tree.leaves(jax.device_get((s.params, s.opt_state))) for s in (single, straight)]
    same = all(np.array_equal(a, b) for a, b in zip(*leaves))
    print(name, strategy, same)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="--xla_cpu_max_isa names x86-64 instruction sets")
def test_without_fma_instructions_the_optimizers_update_is_bit_for_bit_laid_out_straight():
    """Why the ring's momentum and shard_map's Adam end an ulp apart laid out straight (docs/train-step.md): LLVM
    contracts another set of multiply-adds into FMAs where XLA fuses the update's expression otherwise. Without
    FMA instructions every one is the single steps' state, bit for bit."""
    from conftest import run_cli

    out = run_cli("-c", FMA_PROBE, env={"XLA_FLAGS": "--xla_cpu_max_isa=AVX"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout.splitlines()[-2:]
    assert said == ["momentum ring True", "adam shard_map True"], out.stdout + out.stderr[-2000:]
