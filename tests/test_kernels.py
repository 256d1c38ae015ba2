"""The Pallas softmax cross-entropy kernel: equal to its jnp reference (values, gradients, dtypes, odd shapes),
inside every strategy's step, and lowered for CUDA (Triton) on this CPU host."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import needs_fashion_mnist, run_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain import compat, models
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import rows, softmax_ce
from jaxtrain.models import classify

SHAPES = [(100, 10), (37, 1000), (16, 10), (1, 10), (130, 3)]  # batch not a multiple of the block; odd classes


def _problem(batch, classes, dtype=jnp.float32, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    logits = (4 * jax.random.normal(k1, (batch, classes))).astype(dtype)
    labels = jax.random.randint(k2, (batch,), 0, classes)
    weights = jax.random.uniform(k3, (batch,))  # a cotangent that differs per row
    return logits, labels, weights


def _value_and_grad(ce, logits, labels, weights):
    return jax.jit(jax.value_and_grad(lambda x: (ce(x, labels) * weights).sum()))(logits)


@pytest.mark.parametrize(("batch", "classes"), SHAPES)
def test_forward_and_gradient_equal_the_reference(batch, classes):
    logits, labels, weights = _problem(batch, classes)
    np.testing.assert_allclose(jax.jit(softmax_ce.cross_entropy)(logits, labels),
                               optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-5, atol=1e-6)
    value, grad = _value_and_grad(softmax_ce.cross_entropy, logits, labels, weights)
    ref_value, ref_grad = _value_and_grad(softmax_ce.reference, logits, labels, weights)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)  # entries are O(1): a few fp32 ulps
    assert np.abs(ref_grad).max() > 0.01  # a gradient worth comparing


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_logits_are_read_as_is_and_the_gradient_keeps_their_dtype(dtype):
    logits, labels, weights = _problem(100, 10, dtype)
    # the kernel computes in fp32 from the half-precision values: equal to fp32 maths on the same values
    np.testing.assert_allclose(softmax_ce.cross_entropy(logits, labels), softmax_ce.reference(logits, labels),
                               rtol=1e-5, atol=1e-6)
    value, grad = _value_and_grad(softmax_ce.cross_entropy, logits, labels, weights)
    _, ref_grad = _value_and_grad(softmax_ce.reference, logits.astype(jnp.float32), labels, weights)
    assert grad.dtype == dtype
    np.testing.assert_allclose(grad.astype(jnp.float32), ref_grad, rtol=1e-2, atol=1e-3)  # half-precision rounding


def test_the_kernel_runs_inside_shard_map_with_varying_types_checked():
    mesh = jt.make_mesh(2)
    logits, labels, weights = _problem(64, 10)
    grad_fn = jax.grad(lambda x, y, w: (softmax_ce.cross_entropy(x, y) * w).sum())
    sharded = jax.device_put((logits, labels, weights), NamedSharding(mesh, P(jt.DATA_AXIS)))
    inside = jax.jit(jax.shard_map(grad_fn, mesh=mesh, in_specs=P(jt.DATA_AXIS), out_specs=P(jt.DATA_AXIS),
                                   check_vma=True))(*sharded)
    np.testing.assert_allclose(inside, grad_fn(logits, labels, weights), rtol=1e-6)


def test_the_kernel_and_its_gradient_lower_for_cuda_through_triton():
    logits, labels, weights = _problem(100, 1000)
    fn = jax.jit(jax.value_and_grad(lambda x: (softmax_ce.cross_entropy(x, labels) * weights).sum()))
    with compat.cuda_kernel_target():
        cuda = fn.trace(logits).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("__gpu$xla.gpu.triton") == 2  # the forward and the backward kernel
    assert "stablehlo.while" not in cuda  # not the interpret-mode loop
    cpu = fn.trace(logits).lower().as_text()
    assert "triton" not in cpu and "stablehlo.while" in cpu  # interpret mode here
    assert rows.BLOCK_ROWS & (rows.BLOCK_ROWS - 1) == 0  # Triton wants powers of two


def _lenet_steps(strategy, kernels, devices=2, steps=3):
    model = models.get("lenet", kernels=kernels)
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.5), mesh=jt.make_mesh(jax.devices()[:devices]),
                                 strategy=strategy)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    losses = []
    for step in range(steps):
        state, metrics = trainer(state, model.example_batch(32, seed=step))
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses


def test_the_lenet_loss_goes_through_the_kernel_forward_and_backward():
    model = models.get("lenet", kernels="pallas")
    params, _ = model.init(jax.random.key(0))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: model.loss_fn(p, {}, model.example_batch(8), None)[0]))(params))
    assert "forward_kernel" in jaxpr and "backward_kernel" in jaxpr  # (each in a CPU and a GPU branch)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda p: models.get("lenet").loss_fn(
        p, {}, model.example_batch(8), None)[0])(params))


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_a_lenet_step_with_the_kernel_equals_the_default_step(strategy):
    ref, _ = _lenet_steps("jit", "jnp", devices=1)
    jnp_params, jnp_losses = _lenet_steps(strategy, "jnp")
    params, losses = _lenet_steps(strategy, "pallas")
    np.testing.assert_allclose(losses, jnp_losses, rtol=1e-5)
    for a, b, r in zip(jax.tree.leaves(params), jax.tree.leaves(jnp_params), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=strategy)
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7, err_msg=f"{strategy} vs 1 device")
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not compat.TRITON_FALLBACK_WITHOUT_GPU,
                    reason="this jax's Triton lowering needs a GPU device kind, which a CPU-device mesh cannot hold "
                           "(jaxtrain.compat.cuda_kernel_target)")
@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_a_train_step_with_the_kernel_lowers_for_cuda(strategy):
    model = models.get("lenet", kernels="pallas")
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=2, strategy=strategy, precision="bf16")
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    cuda = trainer.lower(state, model.example_batch(64), platforms=("cuda",)).as_text()
    assert cuda.count("__gpu$xla.gpu.triton") == 2 and "stablehlo.convolution" in cuda


def test_kernels_are_checked_where_models_are_built():
    with pytest.raises(ConfigError, match="unknown kernels 'cuda': choose one of jnp, pallas"):
        models.get("lenet", kernels="cuda")
    with pytest.raises(ValueError, match="unknown kernels"):
        classify.cross_entropy(jnp.zeros((2, 10)), jnp.zeros(2, jnp.int32), kernels="triton")
    head = classify.loss_head("pallas")
    logits, labels, _ = _problem(20, 10)
    loss, metrics = head(logits, {"label": labels})
    np.testing.assert_allclose(loss, classify.label_loss(logits, {"label": labels})[0], rtol=1e-6)


@pytest.mark.parametrize("name", ["resnet18", "vit"])
def test_other_models_take_the_kernel_too(name):
    model, plain = models.get(name, kernels="pallas"), models.get(name)
    params, state = model.init(jax.random.key(0))
    batch = model.example_batch(4)
    loss = jax.jit(functools.partial(model.loss_fn, rng=jax.random.key(1)))(params, state, batch)[0]
    ref = jax.jit(functools.partial(plain.loss_fn, rng=jax.random.key(1)))(params, state, batch)[0]
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


@needs_fashion_mnist
@pytest.mark.slow
def test_the_kernels_flag_trains_lenet_from_the_command_line(tmp_path):
    r = run_cli("-m", "experiments.lenet", "--devices", "2", "--strategy", "shard_map", "--kernels", "pallas",
                "--epochs", "1", "--train-subset", "2048", "--test-subset", "512", "--out", str(tmp_path),
                "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "Pallas cross-entropy kernel" in r.stdout
    r = run_cli("-m", "experiments.lenet", "--kernels", "cuda", "--max-steps", "1")
    assert r.returncode == 2 and "--kernels" in r.stderr and "Traceback" not in r.stderr
