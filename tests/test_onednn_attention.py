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


@pytest.mark.parametrize("unroll", [False, True])
def test_a_step_s_flops_count_the_products_in_every_trip_of_the_blocks_loop(unroll):
    """A review's finding: the products in a loop over the blocks (a CPU's default on more than one device) were
    counted once, not once per block; the step's FLOPs with oneDNN's products are XLA's attention's."""
    import optax

    import jaxtrain as jt
    from jaxtrain.analysis import diagnostics

    def flops(conv):
        model = models.get("gpt", input_shape=(32,), num_classes=100, size="tiny", conv=conv, unroll=unroll)
        trainer = jt.make_train_step(model.loss_fn, optax.sgd(0.1), mesh=1)
        state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
        compiled = trainer.lower(state, model.example_batch(4)).compile()
        assert ("JaxtrainDnnlBmm" in compiled.as_text()) == (conv == "auto")
        return diagnostics.program_flops(compiled)

    assert flops("auto") == pytest.approx(flops("xla"), rel=0.02)


@pytest.mark.parametrize("strategy", ["jit", "explicit"])
def test_accumulation_with_the_heads_over_model_gathers_no_more_than_xla_s_attention(strategy):
    """A review's finding: jit's and the explicit strategy's accumulation run the loss in a shard_map manual over
    'data' only, where a bare call had its heads all-gathered over 'model' on every device; there the attention
    is XLA's."""
    import dataclasses

    import optax

    import jaxtrain as jt
    from jaxtrain.parallel import rules

    config = gpt.Config(vocab=100, seq_len=16, layers=2, heads=2, width=32)
    batch = {"tokens": jnp.zeros((8, 17), jnp.int32)}

    def program(attention):
        c = dataclasses.replace(config, attention=attention)
        trainer = jt.make_train_step(gpt.make_loss_fn(c), optax.sgd(0.1), mesh=jt.make_mesh(4, axes={"data": 2,
                                     "model": 2}), strategy=strategy, accum_steps=2,
                                     param_sharding=rules.preset("tp", gpt.LOGICAL_AXES))
        state = trainer.init(gpt.init(jax.random.key(0), c), {})
        return trainer.lower(state, batch).compile().as_text()

    dnn = program("onednn")
    assert "JaxtrainDnnlBmm" not in dnn and dnn.count("all-gather") == program("xla").count("all-gather")


def test_where_the_library_is_not_usable_the_gpt_takes_xla_s_attention_saying_so(monkeypatch, caplog):
    """A review's finding: a GPT built for oneDNN's products raised where the library could not load, and a CPU
    run without it was warned of the convolutions'. Now: XLA's attention, one line about the attention's products;
    ``conv="onednn"`` asked for is refused in one line."""
    from jaxtrain.errors import ConfigError

    monkeypatch.setattr(onednn, "available", lambda: False)
    monkeypatch.setattr(onednn, "reason", lambda: "no compiler: install g++")
    monkeypatch.setattr(onednn, "expected", lambda: True)
    onednn._say_fallback.cache_clear()
    with caplog.at_level("WARNING", logger="jaxtrain"):
        model = models.get("gpt", input_shape=(16,), num_classes=100, size="tiny")
    assert model.config.attention == "xla"
    assert caplog.text.count("oneDNN's attention products are not usable (no compiler: install g++); XLA's run "
                             "instead") == 1 and "convolutions" not in caplog.text
    q = _random(2, 8, 2, 4)
    assert "JaxtrainDnnlBmm" not in jax.jit(attention).lower(q, q, q).as_text()  # a model built for it: XLA's
    with pytest.raises(ConfigError, match="conv=onednn"):
        models.get("gpt", input_shape=(16,), num_classes=100, size="tiny", conv="onednn")
    onednn._say_fallback.cache_clear()
