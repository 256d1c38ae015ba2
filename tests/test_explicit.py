"""strategy="explicit": the shardings in the arrays' types. A model that types its own layers trains unchanged;
a model that knows no mesh runs under auto_axes; both equal the independent 1-device reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_batch
from reference import reference_runs
from tolerance import assert_state_reassociated
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain.models import lenet

# Adam: eps=1e-6 as in test_step (noise-level gradient elements).
SEEN = []  # what the explicit model read of its input's type, per trace


def explicit_mlp_loss(params, model_state, batch, key):
    """A user's explicit-sharding model: it reads its activations' shardings and says where a contraction over a
    sharded dimension goes (``out_sharding``), as explicit mode demands; outside any mesh it is plain jnp."""
    x = batch["image"].reshape(batch["image"].shape[0], -1)
    spec = jax.typeof(x).sharding.spec
    SEEN.append(spec)
    h = jnp.tanh(x @ params["w1"] + params["b1"])  # w1: replicated, or P(None, "model") under TP
    if jax.sharding.get_abstract_mesh().empty:
        logits = h @ params["w2"]
    else:  # h's hidden units may be split over "model" (TP): the sum over them is placed explicitly
        logits = jnp.einsum("bh,hc->bc", h, params["w2"], out_sharding=P(spec[0] if len(spec) else None, None))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, (model_state, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])})


def mlp_params():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"w1": 0.05 * jax.random.normal(k1, (784, 32)), "b1": jnp.zeros((32,)),
            "w2": 0.1 * jax.random.normal(k2, (32, 10))}


TP = [(r"w1$", P(None, "model")), (r"b1$", P("model")), (r"w2$", P("model", None))]
CASES = {"replicated-4": (4, {}), "fsdp-4": (4, {"param_sharding": "fsdp", "min_size": 256}),
         "zero1-4": (4, {"param_sharding": "zero1", "min_size": 256}),
         "tp-2x2": ({"data": 2, "model": 2}, {"param_sharding": TP}),
         "tp-2x2-accum2": ({"data": 2, "model": 2}, {"param_sharding": TP, "accum_steps": 2})}
BATCHES = [random_batch(32, seed=s) for s in range(3)]


@pytest.mark.parametrize("case", CASES)
def test_a_users_explicit_sharding_model_trains_unchanged_and_equals_the_reference(case):
    mesh, kw = CASES[case]
    mesh = jt.make_mesh(4, mesh if isinstance(mesh, dict) else None)
    trainer = jt.make_train_step(explicit_mlp_loss, optax.adam(1e-3, eps=1e-6), mesh=mesh, strategy="explicit",
                                 model_axes="explicit", **kw)
    SEEN.clear()
    state, history = trainer.init(mlp_params()), []
    for b in BATCHES:
        state, metrics = trainer(state, b)
        history.append(jax.device_get(metrics))
    seen = list(SEEN)
    SEEN.clear()
    reference = reference_runs(explicit_mlp_loss, lambda: optax.adam(1e-3, eps=1e-6), mlp_params(), BATCHES,
                               accum_steps=kw.get("accum_steps", 1))
    assert_state_reassociated(jax.device_get(state), history, *reference)
    # The model saw typed arrays: its batch split over "data" (per device under accumulation: shard_map).
    assert seen and all(s[0] == (None if "accum" in case else jt.DATA_AXIS) for s in seen), seen
    w1 = state.params["w1"]
    assert all(t == AxisType.Explicit for t in w1.sharding.mesh.axis_types)
    if "tp" in case:
        assert w1.sharding.spec == P(None, "model")
    if case.startswith(("fsdp", "zero1")):
        placed = state.params["w1"] if case.startswith("fsdp") else state.opt_state[0].mu["w1"]
        assert placed.sharding.spec == P(jt.DATA_AXIS, None)


def test_the_explicit_strategy_types_the_mesh_and_the_rest_keep_auto_axes():
    explicit_mesh = jax.make_mesh((2,), (jt.DATA_AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    auto = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=explicit_mesh, strategy="jit")
    typed = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, strategy="explicit")
    assert auto.mesh.axis_types == (AxisType.Auto,) and typed.mesh.axis_types == (AxisType.Explicit,)
    state = typed.init(lenet.init_params(jax.random.key(0)))
    state, _ = typed(state, random_batch(8))
    assert jax.tree.leaves(state.params)[0].sharding.mesh.axis_types == (AxisType.Explicit,)
    sums = jt.make_eval_step(lenet.make_eval_fn(), mesh=2, strategy="explicit")(state, random_batch(8))
    assert float(sums["count"]) == 8


def test_a_model_that_does_not_type_check_under_explicit_axes_is_a_one_line_error():
    """LeNet knows no mesh: its pooling reshapes a batch-sharded array, which explicit mode refuses."""
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, strategy="explicit", model_axes="explicit")
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    with pytest.raises(jt.ConfigError, match="model_axes='auto'") as e:
        trainer(state, random_batch(8))
    assert "\n" not in str(e.value)


def test_model_axes_is_checked():
    with pytest.raises(jt.ConfigError, match="unknown model_axes='typed'"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, strategy="explicit", model_axes="typed")
    with pytest.raises(jt.ConfigError, match="needs strategy='explicit'|only strategy='explicit'"):
        jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, strategy="jit", model_axes="explicit")


def test_explicit_fsdp_gathers_once_and_reduces_the_gradients_once():
    """The reshards are the step's only collectives: each FSDP parameter all-gathered once; the gradients reduced
    in one all-reduce (XLA:CPU: all-reduce + slice for the sharded ones, as under jit)."""
    params = lenet.init_params(jax.random.key(0))
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=4, strategy="explicit", param_sharding="fsdp")
    got = jt.compiled_stats(trainer, trainer.init(params), random_batch(16), residuals=False)["collectives"]
    sharded = 4 * sum(params[k]["w"].size for k in ("conv2", "dense1", "dense2"))
    assert got["all-gather"] == {"ops": 3, "bytes": sharded}
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    reduced = got["all-reduce"]["bytes"] + got.get("reduce-scatter", {}).get("bytes", 0)
    assert got["all-reduce"]["ops"] == 1 and grad_bytes <= reduced <= grad_bytes + 64  # + the loss and metrics
    assert np.isfinite(reduced)


def test_jax_still_reduces_a_reduced_bias_gradient_twice_under_auto_axes():
    """Why jaxtrain does not cast parameters ``reduced`` (JAX's way to get unreduced gradients and reduce them in
    one reshard, docs/train-step.md): under ``auto_axes`` a broadcast-added bias's gradient comes back N times too
    large (jax 0.10.2 and 0.12), while the matmul weight's is right. When this fails, JAX has fixed it: switch."""
    import jax.numpy as jnp
    import numpy as np

    mesh = jax.make_mesh((4,), (jt.DATA_AXIS,), axis_types=(AxisType.Explicit,))
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    p = {"w": np.ones((3, 2), np.float32), "b": np.ones((2,), np.float32)}

    def loss(p, x):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)

    want = jax.grad(loss)(p, x)

    def grads(p, x):
        p = jax.tree.map(lambda v: jax.sharding.reshard(v, P(reduced={jt.DATA_AXIS})), p)
        g = jax.grad(jax.sharding.auto_axes(loss, out_sharding=P()))(p, x)
        return jax.tree.map(lambda v: jax.sharding.reshard(v, P()), g)

    with jax.set_mesh(mesh):
        got = jax.jit(grads)(jax.tree.map(lambda v: jax.device_put(v, P()), p), jax.device_put(x, P(jt.DATA_AXIS)))
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)
    np.testing.assert_allclose(got["b"], 4 * want["b"], rtol=1e-5)  # the bug: 4 devices, 4 times
