"""The kernels' Mosaic GPU versions (jaxtrain.kernels.mosaic; jax >= 0.12): in Mosaic GPU's interpret mode on this
CPU, equal to the jnp references through the same custom VJPs (odd row counts, 10 to 32,000 classes, fp32 and
bf16, inside shard_map with varying types checked); compiled by XLA:GPU for an H100 in the gpu_compile leg, and
Triton kept for an A100."""

import re
from importlib.util import find_spec

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxtrain as jt
from jaxtrain import settings
from jaxtrain.core import compat
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import layer_norm, rows, softmax_ce

needs_mosaic = pytest.mark.skipif(not compat.MOSAIC_GPU_KERNELS,
                                  reason="Mosaic GPU kernels need jax >= 0.12 (make test-latest runs these)")
CE_SHAPES = [(37, 10, jnp.float32), (250, 160, jnp.float32), (65, 1000, jnp.bfloat16), (9, 32000, jnp.bfloat16),
             (1, 10, jnp.float32)]  # rows: a partial block of 64 / of TMA's 8; columns: a partial chunk of 128
LN_SHAPES = [(37, 10, jnp.float32), (250, 160, jnp.float32), (9, 192, jnp.bfloat16), (3, 1000, jnp.float32)]


@pytest.fixture
def mosaic_interpret(use_settings):
    use_settings(pallas_interpret="mosaic")


def _ce_problem(n, c, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return ((4 * jax.random.normal(k1, (n, c))).astype(dtype), jax.random.randint(k2, (n,), 0, c),
            jax.random.uniform(k3, (n,)))


def _ce_value_and_grad(ce, logits, labels, weights):
    return jax.jit(jax.value_and_grad(lambda x: (ce(x, labels) * weights).sum()))(logits)  # a fresh trace per call


@needs_mosaic
@pytest.mark.parametrize(("n", "c", "dtype"), CE_SHAPES)
def test_the_cross_entropy_and_its_gradient_equal_the_reference(mosaic_interpret, n, c, dtype):
    logits, labels, weights = _ce_problem(n, c, dtype)
    value, grad = _ce_value_and_grad(softmax_ce.cross_entropy, logits, labels, weights)
    ref_value, ref_grad = _ce_value_and_grad(softmax_ce.reference, logits.astype(jnp.float32), labels, weights)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)  # fp32 maths on the same values: a few ulps
    assert grad.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=2e-3)  # bf16's rounding
    np.testing.assert_allclose(grad.astype(jnp.float32), ref_grad, **tol)
    assert np.abs(ref_grad).max() > 0.01  # a gradient worth comparing


def _ln_problem(n, d, dtype, seed=1):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    return ((3 * jax.random.normal(k1, (n, d)) + 1).astype(dtype), 1 + 0.5 * jax.random.normal(k2, (d,)),
            jax.random.normal(k3, (d,)), jax.random.normal(k4, (n, d)))


def _ln_grads(ln, x, scale, bias, probe):
    return jax.jit(jax.value_and_grad(lambda *a: (ln(*a).astype(jnp.float32) * probe).sum(), argnums=(0, 1, 2)))(
        x, scale, bias)


@needs_mosaic
@pytest.mark.parametrize(("n", "d", "dtype"), LN_SHAPES)
def test_the_layer_norm_and_its_gradients_equal_the_reference(mosaic_interpret, n, d, dtype):
    x, scale, bias, probe = _ln_problem(n, d, dtype)
    y = jax.jit(lambda *a: layer_norm.layer_norm(*a))(x, scale, bias)
    value, grads = _ln_grads(layer_norm.layer_norm, x, scale, bias, probe)
    ref_value, ref_grads = _ln_grads(layer_norm.reference, x, scale, bias, probe)
    assert y.dtype == dtype and grads[0].dtype == dtype
    # fp32: the statistics merged chunk by chunk, not in one pass; bf16: the output's rounding (1 bf16 ulp)
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=2e-2)
    np.testing.assert_allclose(y.astype(jnp.float32), layer_norm.reference(x, scale, bias).astype(jnp.float32),
                               **tol)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def summed_over_the_devices(lowered_text: str) -> list[str]:
    """The types of what a lowered program all-reduces with an add (a psum over a mesh axis), in order."""
    reductions = re.findall(r'"stablehlo\.all_reduce"(.*?)\}\) : \((tensor<[^>]*>)\)', lowered_text, re.DOTALL)
    return [kind if "stablehlo.add" in region else f"not a sum: {kind}" for region, kind in reductions]


@needs_mosaic
def test_inside_shard_map_with_varying_types_checked(mosaic_interpret):
    """On one device's shard_map: the interpreter of jax 0.12 checks that no barrier is left at a kernel's end
    across ALL devices' simulated memory, so two devices interpreting at once fail it now and then (a JAX
    interpreter limit, not the kernels': on a GPU each device has its own). Varying types are checked all the same,
    and since on one device a sum over the devices changes no number, the program is checked to hold that sum."""
    mesh = jt.make_mesh(1)
    logits, labels, weights = _ce_problem(64, 160, jnp.float32)
    x, scale, bias, probe = _ln_problem(64, 160, jnp.float32)

    def grads(logits, labels, weights, x, scale, bias):
        ce = jax.grad(lambda z: (softmax_ce.cross_entropy(z, labels) * weights).sum())(logits)
        ln = jax.grad(lambda *a: (layer_norm.layer_norm(*a) * x).sum(), argnums=(0, 1, 2))(x, scale, bias)
        return ce, *ln

    specs = (P(jt.DATA_AXIS),) * 4 + (P(), P())
    out_specs = (P(jt.DATA_AXIS), P(jt.DATA_AXIS), P(), P())
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((logits, labels, weights, x, scale, bias), specs)]
    lowered = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=True)).lower(*args)
    # The layer norm's scale and bias gradients, and nothing else, summed over "data" (a psum each): the kernel's
    # per-device partial sums, which on 2+ devices are wrong without it.
    assert summed_over_the_devices(lowered.as_text()) == ["tensor<160xf32>"] * 2
    inside = lowered.compile()(*args)
    ref_ce = jax.grad(lambda z: (softmax_ce.reference(z, labels) * weights).sum())(logits)
    ref_ln = jax.grad(lambda *a: (layer_norm.reference(*a) * x).sum(), argnums=(0, 1, 2))(x, scale, bias)
    for got, want in zip(inside, (ref_ce, *ref_ln)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@needs_mosaic
def test_the_cpu_program_runs_the_mosaic_interpreter_only_when_asked(use_settings):
    logits, labels, _ = _ce_problem(16, 10, jnp.float32)
    def lowered():
        return jax.jit(lambda x: softmax_ce.cross_entropy(x, labels)).lower(logits).as_text()

    triton = lowered()
    use_settings(pallas_interpret="mosaic")
    mosaic = lowered()
    assert "callback" in mosaic and "callback" not in triton  # Mosaic GPU's interpreter simulates through callbacks


def test_a_bad_backend_setting_is_one_line():
    with pytest.raises(ConfigError, match="JAXTRAIN_PALLAS_GPU='cuda': use auto, mosaic or triton"):
        settings.read({"JAXTRAIN_PALLAS_GPU": "cuda"})
    with pytest.raises(ConfigError, match="JAXTRAIN_PALLAS_INTERPRET='gpu': use triton or mosaic"):
        settings.read({"JAXTRAIN_PALLAS_INTERPRET": "gpu"})


def test_without_a_known_hopper_gpu_the_backend_is_triton(use_settings):
    assert rows.backend() == "triton"  # this host's CPUs (and jax < 0.12 everywhere)
    use_settings(pallas_gpu="mosaic")
    assert rows.backend() == ("mosaic" if compat.MOSAIC_GPU_KERNELS else "triton")


# --- compiled for GPUs (the gpu_compile leg: tools/test-gpu-compile) ----------------------------------------------
needs_plugin = pytest.mark.skipif(not find_spec("jax_cuda12_plugin"),
                                  reason="JAX's CUDA plugin is not installed: pip install -e '.[gpu-compile]'")


def _compiled_kernels(gpu_name: str, n: int, c: int, dtype) -> tuple[dict, list]:
    """(what the program calls, the Pallas kernels' launches) of both losses' value-and-gradient, compiled for one
    GPU of ``gpu_name``."""
    import jaxtrain.gpu as gpu
    from jaxtrain.gpu import analysis, launches

    mesh = gpu.mesh_for(gpu_name, gpus=1)
    def shape(s, dt):
        return jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, P()))


    def both(logits, labels, x, scale, bias):
        ce = jax.value_and_grad(lambda z: softmax_ce.cross_entropy(z, labels).sum())(logits)
        ln = jax.grad(lambda *a: layer_norm.layer_norm(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(
            x, scale, bias)
        return ce, ln

    with jax.set_mesh(mesh):  # the kernels read the GPU's kind from the mesh the step traces under
        lowered = jax.jit(both).lower(shape((n, c), dtype), shape((n,), jnp.int32), shape((n, c), dtype),
                                      shape((c,), jnp.float32), shape((c,), jnp.float32))
    compiled, found = launches.compile_with_launches(lowered)
    return analysis.kernels(compiled.as_text()), [k for k in found if k.backend != "xla"]


@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize(("n", "c", "dtype"), CE_SHAPES + LN_SHAPES[-2:])
def test_both_kernels_compile_through_mosaic_gpu_for_an_h100(n, c, dtype):
    kernels, found = _compiled_kernels("h100", n, c, dtype)
    assert kernels["pallas_backends"] == {"mosaic": 4}  # 2 forward, 2 backward
    assert sorted(k.name for k in found) == ["ce_backward", "ce_forward", "ln_backward", "ln_forward"]
    blocks = -(-(n + -n % 8) // 64)  # 64-row blocks over the rows padded to TMA's 8
    # a warpgroup per block; shared memory: a [64, <=128] input tile at least (two once there are 2+ chunks)
    tile = 64 * min(128, c + -c % (128 // jnp.dtype(dtype).itemsize)) * jnp.dtype(dtype).itemsize
    assert all(k.grid == (blocks, 1, 1) and k.threads == 128 and tile <= k.shared_bytes <= 227 * 1024
               and k.registers is None for k in found), found


@pytest.mark.gpu_compile
@needs_plugin
def test_an_a100_keeps_the_triton_kernels_whose_registers_the_cubins_give():
    kernels, found = _compiled_kernels("a100", 65, 1000, jnp.bfloat16)
    assert kernels["pallas_backends"] == {"triton": 4}  # sm_80: no Mosaic GPU
    assert len(found) == 4 and all(k.grid == (rows.programs(65, 1000), 1, 1) and 0 < k.registers <= 255
                                   for k in found), found


@pytest.mark.gpu_compile
@needs_plugin
def test_bench_kernels_prints_each_kernels_launch_for_a_gpu(capsys):
    from experiments import bench_kernels

    assert bench_kernels.main(["--gpu", "h100", "--classes", "10"]) == 0
    out = capsys.readouterr().out
    assert "| cross-entropy 256 x 10 | ce_forward | mosaic | 4x1x1 | 128 |" in out
    assert "| layer norm 3136 x 64 | layer_norm_backward_kernel | triton | 196x1x1 | 128 |" in out
    assert bench_kernels.main(["--gpu", "h1000"]) == 2 and "unknown GPU" in capsys.readouterr().err
