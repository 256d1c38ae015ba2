"""oneDNN's convolutions (jaxtrain.kernels.onednn): XLA's values and gradients, the batch kept split under jit,
typed and summed as lax's conv under shard_map, never lowered for a GPU; ResNet-18 and LeNet on 2 devices under
every strategy equal to the independent 1-device reference step with XLA's convolutions."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from conftest import random_batch
import linen_resnet
from reference import assert_matches
from test_resnet import to_nnx

import jaxtrain as jt
from jaxtrain import diagnostics, models
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import onednn
from jaxtrain.models import resnet

usable = pytest.mark.skipif(not onednn.available(), reason=f"oneDNN convolutions not usable: {onednn.reason()}")
NHWC = ("NHWC", "HWIO", "NHWC")


def test_ci_builds_them():
    """CI installs g++ and libdnnl-dev (.ci/run): there the tests below must run, not skip."""
    if os.environ.get("CI") != "true":
        pytest.skip("outside CI a machine may lack g++ or oneDNN (conv=auto then keeps XLA's)")
    assert onednn.available(), onednn.reason()


def _objective(conv, strides, padding):
    def loss(x, w):
        y = conv(x, w, strides, padding, dimension_numbers=NHWC)
        return (jnp.sin(3 * y) + y * y).sum()  # a gradient that differs per output

    return loss


def _loss(conv, strides, padding):
    return jax.jit(jax.value_and_grad(_objective(conv, strides, padding), argnums=(0, 1)))


def _close(got, want, rtol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=rtol * float(np.max(np.abs(w))))


CASES = {  # x shape, w shape, strides, padding: ResNet-18's kinds, LeNet's two, odd sizes
    "3x3": ((4, 14, 14, 16), (3, 3, 16, 32), (1, 1), ((1, 1), (1, 1))),
    "3x3-stride2": ((4, 14, 14, 16), (3, 3, 16, 32), (2, 2), ((1, 1), (1, 1))),
    "1x1-stride2": ((4, 14, 14, 16), (1, 1, 16, 32), (2, 2), ((0, 0), (0, 0))),
    "lenet-conv1": ((4, 28, 28, 1), (3, 3, 1, 20), (1, 1), "VALID"),
    "lenet-conv2": ((4, 13, 13, 20), (5, 5, 20, 50), (1, 1), "VALID"),
    "odd-same": ((3, 9, 11, 8), (3, 3, 8, 8), (1, 2), "SAME"),
}


@usable
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_equal_xla(case):
    xs, ws, strides, padding = CASES[case]
    x = jax.random.normal(jax.random.key(0), xs)
    w = 0.1 * jax.random.normal(jax.random.key(1), ws)
    got = _loss(onednn.conv_general_dilated, strides, padding)
    assert "JaxtrainDnnlConvBwd" in got.lower(x, w).as_text()  # oneDNN's indeed
    _close(got(x, w), _loss(lax.conv_general_dilated, strides, padding)(x, w))


@usable
@pytest.mark.parametrize("what", ["bf16", "dilation", "groups", "nchw"])
def test_what_onednn_does_not_take_is_xla_s(what):
    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 4))
    kw = dict(dimension_numbers=NHWC)
    if what == "bf16":
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    elif what == "dilation":
        kw["rhs_dilation"] = (2, 2)
    elif what == "groups":
        w, kw["feature_group_count"] = jnp.ones((3, 3, 1, 4)), 4
    else:
        x, kw["dimension_numbers"] = jnp.ones((2, 4, 8, 8)), ("NCHW", "HWIO", "NCHW")
    fn = lambda conv: jax.jit(lambda x, w: conv(x, w, (1, 1), "SAME", **kw))  # noqa: E731
    assert "JaxtrainDnnl" not in fn(onednn.conv_general_dilated).lower(x, w).as_text()
    np.testing.assert_array_equal(fn(onednn.conv_general_dilated)(x, w), fn(lax.conv_general_dilated)(x, w))


@usable
def test_a_gpu_program_has_only_xla_convolutions():
    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 8))
    grads = jax.jit(jax.grad(lambda x, w: onednn.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
                             .sum(), argnums=(0, 1)))
    cuda = grads.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "JaxtrainDnnl" not in cuda and "convolution" in cuda
    assert "JaxtrainDnnl" in grads.lower(x, w).as_text()


def _mesh():
    return jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])


@usable
def test_jit_keeps_the_batch_split_and_sums_the_weight_gradient():
    """Under jit each device convolves its half: no all-gather of the batch (XLA's partitioner would gather it
    for a plain custom call), the input gradient stays split, the weight gradient is the whole batch's."""
    xs, ws, strides, padding = CASES["3x3-stride2"]
    mesh = _mesh()
    x = jax.device_put(jax.random.normal(jax.random.key(0), xs), NamedSharding(mesh, P("data")))
    w = jax.device_put(0.1 * jax.random.normal(jax.random.key(1), ws), NamedSharding(mesh, P()))
    step = _loss(onednn.conv_general_dilated, strides, padding)
    assert "all-gather" not in step.lower(x, w).compile().as_text()
    got = step(x, w)
    assert got[1][0].sharding.spec[0] == "data"
    _close(got, _loss(lax.conv_general_dilated, strides, padding)(jax.device_get(x), jax.device_get(w)))


@usable
@pytest.mark.parametrize("weights", ["invariant", "varying"])
def test_shard_map_types_and_sums_as_lax_does(weights):
    """Inside shard_map the result is varying and the weight gradient summed over the devices exactly when JAX's
    autodiff of lax's conv would sum it (weights invariant), and not when the weights already vary."""
    xs, ws, strides, padding = CASES["3x3"]
    mesh = _mesh()
    x, w = jax.random.normal(jax.random.key(0), xs), 0.1 * jax.random.normal(jax.random.key(1), ws)

    def run(conv):
        def body(x, w):
            w = lax.pcast(w, ("data",), to="varying") if weights == "varying" else w
            return lax.psum(_objective(conv, strides, padding)(x, w), "data")

        whole = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
        return jax.jit(jax.value_and_grad(whole, argnums=(0, 1)))(x, w)

    _close(run(onednn.conv_general_dilated), run(lax.conv_general_dilated))


@pytest.fixture(scope="module")
def variables():
    return to_nnx(*linen_resnet.init_variables(jax.random.key(0), linen_resnet.ResNet18()))


@usable
@pytest.mark.parametrize("strategy,sharding", [*((s, "replicated") for s in jt.STRATEGIES), ("jit", "fsdp"),
                                               ("shard_map", "fsdp")])
def test_resnet18_on_two_devices_equals_the_reference_with_xla_convolutions(variables, strategy, sharding):
    batch = random_batch(8, seed=11)
    fast = resnet.adapter(conv=onednn.conv_general_dilated).loss_fn
    trainer = jt.make_train_step(fast, optax.sgd(0.1), mesh=2, strategy=strategy, param_sharding=sharding)
    state, metrics = trainer(trainer.init(*variables), batch)
    assert_matches(state, [metrics], resnet.adapter().loss_fn, optax.sgd(0.1), variables[0], [batch],
                   model_state=variables[1])


@usable
@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_lenet_on_two_devices_equals_the_reference_with_xla_convolutions(strategy):
    fast, plain = models.get("lenet", conv="onednn"), models.get("lenet", conv="xla")
    assert (fast.conv, plain.conv) == ("onednn", "xla")
    batches = [random_batch(16, seed=s) for s in range(3)]
    params, _ = plain.init(jax.random.key(0))
    trainer = jt.make_train_step(fast.loss_fn, optax.sgd(0.2), mesh=2, strategy=strategy)
    state, history = trainer.init(params), []
    for batch in batches:
        state, metrics = trainer(state, batch)
        history.append(metrics)
    assert_matches(state, history, plain.loss_fn, optax.sgd(0.2), params, batches)


def test_choose_names_the_convolution_and_refuses_what_is_unusable(monkeypatch):
    assert onednn.choose("xla") == ("xla", lax.conv_general_dilated)
    with pytest.raises(ConfigError, match="unknown conv 'cudnn'"):
        onednn.choose("cudnn")
    monkeypatch.setattr(onednn, "reason", lambda: "no C++ compiler found: install ...")
    monkeypatch.setattr(onednn, "available", lambda: False)
    assert onednn.choose("auto")[0] == "xla"  # auto: quietly XLA's
    with pytest.raises(ConfigError, match="conv=onednn: no C\\+\\+ compiler found.*conv=xla"):
        models.get("resnet18", conv="onednn")


def test_a_machine_without_a_compiler_is_told_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXTRAIN_ONEDNN_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(OSError, match="no C\\+\\+ compiler found.*apt-get install g\\+\\+.*onednn-cpu-gomp"):
        onednn.build()
    monkeypatch.setenv("CXX", "false")  # a compiler that fails: no library left behind
    with pytest.raises(OSError, match="building the oneDNN convolutions failed"):
        onednn.build()
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".build")] == []


@usable
@pytest.mark.parametrize("case", ["3x3-stride2", "odd-same", "lenet-conv2"])
def test_flops_are_counted_as_xla_counts_its_convolutions(case):
    """XLA's cost analysis sees nothing in a custom call: ``hlo_flops`` adds oneDNN's, as XLA counts its own."""
    xs, ws, strides, padding = CASES[case]
    x, w = jnp.ones(xs), jnp.ones(ws)
    count = lambda conv: diagnostics.program_flops(_loss(conv, strides, padding).lower(x, w).compile())  # noqa: E731
    assert count(onednn.conv_general_dilated) == pytest.approx(count(lax.conv_general_dilated), rel=1e-3)


@usable
def test_the_blocked_layouts_and_the_saved_input_equal_xla_too(monkeypatch):
    """``JAXTRAIN_ONEDNN_BLOCKED=1`` (read as primitives are made: a shape no other test uses) takes oneDNN's
    blocked layouts, where the forward saves x in the backward-weights layout: that path equals XLA's too."""
    monkeypatch.setenv("JAXTRAIN_ONEDNN_BLOCKED", "1")
    xs, ws, strides, padding = (5, 10, 10, 32), (3, 3, 32, 48), (1, 1), ((1, 1), (1, 1))
    assert onednn._saved_floats(xs, ws, (strides, padding)) > 0  # the saved path is taken
    x = jax.random.normal(jax.random.key(0), xs)
    w = 0.1 * jax.random.normal(jax.random.key(1), ws)
    fast = _loss(onednn.conv_general_dilated, strides, padding)
    assert "JaxtrainDnnlConvFwdSave" in fast.lower(x, w).as_text()
    _close(fast(x, w), _loss(lax.conv_general_dilated, strides, padding)(x, w))


def test_threads_are_the_cores_over_the_devices_or_what_the_environment_says(monkeypatch):
    from jaxtrain.devices import _cores
    from jaxtrain.kernels import onednn_calls

    monkeypatch.delenv("JAXTRAIN_ONEDNN_THREADS", raising=False)
    assert onednn_calls.threads() == max(1, _cores() // jax.local_device_count())
    monkeypatch.setenv("JAXTRAIN_ONEDNN_THREADS", "3")
    assert onednn_calls.threads() == 3
    monkeypatch.setenv("JAXTRAIN_ONEDNN_THREADS", "two")
    with pytest.raises(ConfigError, match="JAXTRAIN_ONEDNN_THREADS=two: must be a whole number >= 1"):
        onednn_calls.threads()
