"""The Pallas kernels (softmax cross-entropy, layer norm): equal to their jnp references (values, gradients,
dtypes, odd shapes), inside every strategy's step, and lowered for CUDA (Triton) on this CPU host."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import needs_fashion_mnist, run_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain import models
from jaxtrain.analysis import diagnostics
from jaxtrain.core import compat
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import layer_norm, rows, softmax_ce
from jaxtrain.models import classify

# batch not a multiple of the block; odd classes; rows wider than 1024 (fewer rows per block: 5000 -> 2, 20000 -> 1)
SHAPES = [(100, 10), (37, 1000), (16, 10), (1, 10), (130, 3), (9, 5000), (3, 20000)]


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


def test_the_kernel_and_its_gradient_lower_for_cuda_through_triton(use_settings):
    use_settings(pallas_gpu="triton")  # an H100 target takes Mosaic GPU on jax >= 0.12 (test_kernels_mosaic)
    logits, labels, weights = _problem(100, 1000)
    fn = jax.jit(jax.value_and_grad(lambda x: (softmax_ce.cross_entropy(x, labels) * weights).sum()))
    with compat.cuda_kernel_target():
        cuda = fn.trace(logits).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("__gpu$xla.gpu.triton") == 2  # the forward and the backward kernel
    assert "stablehlo.while" not in cuda  # not the interpret-mode loop
    cpu = fn.trace(logits).lower().as_text()
    assert "triton" not in cpu and "stablehlo.while" in cpu  # interpret mode here
    for cols in (3, 10, 1000, 5000, 20000, 50000):  # Triton wants powers of two; tiles stay register-sized
        n, width = rows.block_rows(cols), 1 << (cols - 1).bit_length()  # Triton's row: the next power of two
        assert n & (n - 1) == 0 and 1 <= n <= 16 and (n == 1 or n * width <= rows.TILE)
    vocab = jnp.zeros((8, 32000)), jnp.zeros(8, jnp.int32)  # a 32k-vocabulary loss: one row per program, 8 warps
    with compat.cuda_kernel_target():
        wide = jax.jit(softmax_ce.cross_entropy).trace(*vocab).lower(lowering_platforms=("cuda",))
    assert wide.as_text().count("__gpu$xla.gpu.triton") == 1


def _lenet_steps(strategy, kernels, devices=2, steps=3, accum_steps=1):
    model = models.get("lenet", kernels=kernels)
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.5), mesh=jt.make_mesh(jax.devices()[:devices]),
                                 strategy=strategy, accum_steps=accum_steps)
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    losses = []
    for step in range(steps):
        state, metrics = trainer(state, model.example_batch(32, seed=step))
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses


@functools.cache  # the 1-device run every strategy's case compares with: once per test process
def _lenet_reference(accum_steps):
    return _lenet_steps("jit", "jnp", devices=1, accum_steps=accum_steps)


def test_the_lenet_loss_goes_through_the_kernel_forward_and_backward():
    model = models.get("lenet", kernels="pallas")
    params, _ = model.init(jax.random.key(0))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: model.loss_fn(p, {}, model.example_batch(8), None)[0]))(params))
    assert "forward_kernel" in jaxpr and "backward_kernel" in jaxpr  # (each in a CPU and a GPU branch)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda p: models.get("lenet").loss_fn(
        p, {}, model.example_batch(8), None)[0])(params))


@pytest.mark.parametrize(("strategy", "accum_steps"), [(s, 1) for s in jt.STRATEGIES] + [("jit", 2)])
def test_a_lenet_step_with_the_kernel_equals_the_default_step(strategy, accum_steps):
    ref, _ = _lenet_reference(accum_steps)
    jnp_params, jnp_losses = _lenet_steps(strategy, "jnp", accum_steps=accum_steps)
    params, losses = _lenet_steps(strategy, "pallas", accum_steps=accum_steps)
    np.testing.assert_allclose(losses, jnp_losses, rtol=1e-5)
    for a, b, r in zip(jax.tree.leaves(params), jax.tree.leaves(jnp_params), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=strategy)
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7, err_msg=f"{strategy} vs 1 device")
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("name", "param_sharding"), [("lenet", "replicated"), ("vit", "replicated"), ("vit", "fsdp")])
def test_under_jit_each_device_runs_the_kernels_on_its_own_rows(name, param_sharding):
    """GSPMD cannot split a kernel: left to it, every device would gather the whole batch's activations and run
    all rows. The step's collectives with the kernels must be exactly those without."""
    collectives = {}
    for kernels in ("jnp", "pallas"):
        model = models.get(name, kernels=kernels)
        trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=2, param_sharding=param_sharding)
        state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
        stats = diagnostics.compiled_stats(trainer, state, model.example_batch(64), residuals=False)
        collectives[kernels] = stats["collectives"]
    assert "all-gather" not in collectives["jnp"] or param_sharding == "fsdp"
    assert collectives["pallas"] == collectives["jnp"]


@pytest.mark.skipif(not compat.TRITON_FALLBACK_WITHOUT_GPU,
                    reason="this jax's Triton lowering needs a GPU device kind, which a CPU-device mesh cannot hold "
                           "(jaxtrain.core.compat.cuda_kernel_target)")
@pytest.mark.parametrize(("name", "strategy"), [("lenet", s) for s in jt.STRATEGIES] + [("vit", "jit")])
def test_a_train_step_with_the_kernels_lowers_for_cuda(name, strategy):
    model = models.get(name, kernels="pallas")
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=2, strategy=strategy, precision="bf16")
    state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
    cuda = trainer.lower(state, model.example_batch(64), platforms=("cuda",)).as_text()
    # cross-entropy forward + backward; the ViT's 3 layer norms (2 in the block its scan runs, 1 in the head) both ways
    assert cuda.count("__gpu$xla.gpu.triton") == {"lenet": 2, "vit": 8}[name]


def test_kernels_are_checked_where_models_are_built():
    with pytest.raises(ConfigError, match="unknown kernels 'cuda': choose one of jnp, pallas"):
        models.get("lenet", kernels="cuda")
    with pytest.raises(ValueError, match="unknown kernels"):
        classify.cross_entropy(jnp.zeros((2, 10)), jnp.zeros(2, jnp.int32), kernels="triton")
    head = classify.loss_head("pallas")
    logits, labels, _ = _problem(20, 10)
    loss, metrics = head(logits, {"label": labels})
    np.testing.assert_allclose(loss, classify.label_loss(logits, {"label": labels})[0], rtol=1e-6)


LN_SHAPES = [(4, 49, 64), (37, 10), (16, 64), (3, 100), (1, 1000), (5, 3000)]  # the ViT's; partial blocks; widths


def _ln_problem(shape, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    x = (3 * jax.random.normal(k[0], shape) + 1).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(k[1], shape[-1:])
    bias = 0.1 * jax.random.normal(k[2], shape[-1:])
    return x, scale, bias, jax.random.normal(k[3], shape)


def _ln_value_and_grads(norm, x, scale, bias, weights):
    return jax.jit(jax.value_and_grad(lambda x, s, b: (norm(x, s, b).astype(jnp.float32) * weights).sum(),
                                      argnums=(0, 1, 2)))(x, scale, bias)


@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layer_norm_and_its_gradients_equal_the_reference(shape):
    x, scale, bias, weights = _ln_problem(shape)
    np.testing.assert_allclose(jax.jit(layer_norm.layer_norm)(x, scale, bias), layer_norm.reference(x, scale, bias),
                               rtol=1e-5, atol=1e-5)
    value, grads = _ln_value_and_grads(layer_norm.layer_norm, x, scale, bias, weights)
    ref_value, ref_grads = _ln_value_and_grads(layer_norm.reference, x, scale, bias, weights)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-4)
    for got, ref, name in zip(grads, ref_grads, ("x", "scale", "bias")):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=name)


def test_layer_norm_in_bf16_keeps_the_dtype_and_rounds_like_the_reference():
    x, scale, bias, weights = _ln_problem((4, 49, 64), jnp.bfloat16)
    y, ref = layer_norm.layer_norm(x, scale, bias), layer_norm.reference(x, scale, bias)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), ref.astype(jnp.float32), rtol=1e-2, atol=1e-2)
    (_, grads), (_, ref_grads) = (_ln_value_and_grads(f, x, scale, bias, weights)
                                  for f in (layer_norm.layer_norm, layer_norm.reference))
    assert grads[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(grads[0].astype(jnp.float32), ref_grads[0].astype(jnp.float32), rtol=2e-2, atol=2e-2)


def test_layer_norm_under_shard_map_sums_the_scale_gradient_over_the_devices():
    mesh = jt.make_mesh(2)
    x, scale, bias, _ = _ln_problem((8, 49, 64))

    def grad(norm):  # d/d(scale, bias)
        return jax.grad(lambda s, b, x: (norm(x, s, b) ** 2).sum() / 100, argnums=(0, 1))

    sharded = jax.device_put(x, NamedSharding(mesh, P(jt.DATA_AXIS)))
    got = jax.jit(jax.shard_map(grad(layer_norm.layer_norm), mesh=mesh, in_specs=(P(), P(), P(jt.DATA_AXIS)),
                                out_specs=P(), check_vma=True))(scale, bias, sharded)
    for a, b in zip(got, grad(layer_norm.reference)(scale, bias, x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_layer_norm_lowers_for_cuda_through_triton(use_settings):
    use_settings(pallas_gpu="triton")  # an H100 target takes Mosaic GPU on jax >= 0.12 (test_kernels_mosaic)
    x, scale, bias, weights = _ln_problem((4, 49, 64))
    fn = jax.jit(jax.grad(lambda x, s, b: (layer_norm.layer_norm(x, s, b) * weights).sum(), argnums=(0, 1, 2)))
    with compat.cuda_kernel_target():
        cuda = fn.trace(x, scale, bias).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("__gpu$xla.gpu.triton") == 2 and "stablehlo.while" not in cuda


def _vit_steps(strategy, kernels, devices=2, steps=2, **mesh_kw):
    model = models.get("vit", kernels=kernels)
    mesh = jt.make_mesh(jax.devices()[:devices], **mesh_kw)
    if "stage" in mesh.axis_names:
        trainer = jt.make_pipeline_step(model.stack.embed_fn, model.stack.stage_fn, model.stack.head_loss_fn,
                                        optax.sgd(0.1), mesh=mesh, microbatches=2)
    else:
        trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=mesh, strategy=strategy)
    state = trainer.init(init_fn=lambda rng: vit_init(rng), rng=jax.random.key(0))
    for step in range(steps):
        state, metrics = trainer(state, model.example_batch(8, seed=step))
    return jax.device_get(state.params)


def vit_init(rng):
    from jaxtrain.models import vit

    params = vit.init(rng, depth=2)
    params["head"]["w"] = 0.1 * jax.random.normal(rng, params["head"]["w"].shape)  # a gradient into the blocks
    return params, {}


@functools.cache  # as _lenet_reference
def _vit_reference():
    return _vit_steps("jit", "jnp", devices=1)


@pytest.mark.parametrize(("strategy", "mesh_kw"), [("jit", {}), ("shard_map", {}), ("ring", {}),
                                                   ("pipeline", {"axes": {"data": 1, "stage": 2}})])
def test_a_vit_step_with_the_kernels_equals_the_default_step(strategy, mesh_kw):
    ref = _vit_reference()
    params = _vit_steps(strategy, "pallas", **mesh_kw)
    for a, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):  # pipelined stages reshape to [layers, ...]
        np.testing.assert_allclose(np.reshape(a, r.shape), r, rtol=1e-5, atol=1e-6, err_msg=strategy)


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


@pytest.mark.slow
def test_bench_kernels_prints_the_bytes_table(tmp_path):
    r = run_cli("-m", "experiments.bench_kernels", "--batch-size", "32", "--classes", "10", "--repeats", "2",
                "--json", str(tmp_path / "k.json"))
    assert r.returncode == 0, r.stderr
    assert "| cross-entropy | 32 x 10 |" in r.stdout and "| layer norm | 3136 x 64 |" in r.stdout
    figures = json.loads((tmp_path / "k.json").read_text())
    for row in figures["kernels"]:
        assert 0 < row["kernel_bytes"] < row["xla_bytes"] and row["kernel_ms"] > 0, row
        assert row["kernel_runs_as"] == "interpret", row
    assert set(figures["steps"]) == {"lenet", "vit"} and set(figures["steps"]["vit"]) == {"jnp", "pallas"}
    r = run_cli("-m", "experiments.bench_kernels", "--classes", "ten")
    assert r.returncode == 2 and "argument --classes: expected comma-separated whole numbers" in r.stderr \
        and "Traceback" not in r.stderr
