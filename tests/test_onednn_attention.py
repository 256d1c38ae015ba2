"""The GPT's attention with oneDNN's batched products on CPU (jaxtrain.kernels.onednn_attention): XLA's values and
gradients, each item's product whatever the items beside it, the items kept split under jit (batch over data,
heads over model) with no collective, never lowered for a GPU, counted in the compiled FLOPs; a CPU's GPT takes it
unless told ``conv="xla"``. The GPT's equivalence tests (tests/test_gpt.py, tests/test_gpt_pipeline.py) run its
steps under every strategy on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_onednn import onednn_library, usable  # noqa: F401  (the fixture usable names)

from jaxtrain import models
from jaxtrain.kernels import onednn
from jaxtrain.kernels.onednn_attention import attention, bmm
from jaxtrain.models import gpt

pytestmark = usable


def _random(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_each_product_is_xla_s_and_each_item_its_own_and_counted(ta, tb):
    m, k, p = 16, 8, 12
    a = _random(4, 3, *((k, m) if ta else (m, k)))
    b = _random(4, 3, *((p, k) if tb else (k, p)), seed=1)
    got = jax.jit(lambda a, b: bmm(a, b, ta, tb))
    want = jnp.einsum("bhmk,bhkp->bhmp", jnp.swapaxes(a, -1, -2) if ta else a, jnp.swapaxes(b, -1, -2) if tb else b)
    np.testing.assert_allclose(got(a, b), want, rtol=1e-6, atol=1e-6)
    halves = jnp.concatenate([got(a[:2], b[:2]), got(a[2:], b[2:])])  # the same items, fewer beside each
    assert bool(jnp.array_equal(halves, got(a, b)))
    assert onednn.hlo_flops(got.lower(a, b).compile().as_text()) == 2 * 4 * 3 * m * k * p


def test_the_attention_and_its_gradients_are_dot_product_attention_s():
    q, k, v = (_random(4, 16, 2, 8, seed=s) for s in range(3))

    def grads(f):
        return jax.jit(jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    np.testing.assert_allclose(jax.jit(attention)(q, k, v), xla(q, k, v), rtol=1e-6, atol=1e-6)
    for got, want in zip(grads(attention), grads(xla)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("axes,spec", [({"data": 2}, P("data")), ({"data": 1, "model": 2}, P("data", None, "model"))])
def test_under_jit_each_device_computes_its_items_with_no_collective(axes, spec):
    """The batch over data or the heads over model: each device's share in one call, no all-gather, all-to-all or
    other collective; the outputs and gradients those of the one-device program within XLA's own rounding (its
    softmax's and the loss's reductions are compiled for the shares: XLA's attention moves as much; the products
    alone are bit for bit, above)."""
    q, k, v = (_random(4, 16, 2, 8, seed=s) for s in range(3))
    step = jax.jit(jax.grad(lambda *a: (attention(*a) ** 2).sum(), argnums=(0, 1, 2)))
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    split = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    program = step.lower(*split).compile().as_text()
    assert "JaxtrainDnnlBmm" in program
    assert not [c for c in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter") if c in program]
    out = jax.jit(attention)(*split)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim)
    np.testing.assert_allclose(out, jax.jit(attention)(q, k, v), rtol=1e-6, atol=1e-6)
    for got, want in zip(step(*split), step(q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))


def test_a_gpu_program_has_only_xla_s_attention():
    q = _random(2, 8, 2, 4)
    grads = jax.jit(jax.grad(lambda q: attention(q, q, q).sum()))
    assert "JaxtrainDnnlBmm" not in grads.trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert "JaxtrainDnnlBmm" in grads.lower(q).as_text()


def test_a_cpu_s_gpt_takes_onednn_s_products_in_fp32_unless_told_xla():
    def get(**kw):
        return models.get("gpt", input_shape=(16,), num_classes=100, size="tiny", **kw)

    assert get().config.attention == "onednn" and get(conv="xla").config.attention == "xla"
    assert gpt.attention_implementation("onednn", jnp.float32) == "onednn"
    assert gpt.attention_implementation("onednn", jnp.bfloat16) == "xla"  # an f32 kernel: XLA's in bf16
    tokens = {"tokens": jnp.zeros((2, 17), jnp.int32)}

    def program(model):
        params = model.init(jax.random.key(0))[0]
        return jax.jit(jax.grad(lambda p: model.loss_fn(p, {}, tokens, None)[0])).lower(params).as_text()

    assert "JaxtrainDnnlBmm" in program(get()) and "JaxtrainDnnlBmm" not in program(get(conv="xla"))
