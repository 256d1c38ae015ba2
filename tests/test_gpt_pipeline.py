"""The GPT pipelined (jaxtrain.train.pipeline with gpt.make_stack): its head reads the tied embedding
(``head_reads_embed``), GPipe and the circular schedule equal the unpipelined GPT's 1-device step, the tied
embedding included, and E's gradient is the sum of its two uses (the first stage's embedding, the last's head)."""

import functools

import jax
import numpy as np
import optax
import pytest
from reference import float64_steps
from tolerance import assert_reassociated

import jaxtrain as jt
from jaxtrain.kernels import onednn
from jaxtrain.models import gpt
from jaxtrain.models.sequential import sequential_loss
from jaxtrain.train import pipeline

CPU_ATTENTION = "onednn" if onednn.available() else "xla"  # as tests/test_gpt.py
CONFIG = gpt.Config(vocab=100, seq_len=8, layers=4, heads=2, width=32, attention=CPU_ATTENTION)  # wte: 128 rows
STACK = gpt.make_stack(CONFIG)
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(1e-3)}


def batch_of(size, seed):
    return {"tokens": np.random.default_rng(seed).integers(0, CONFIG.vocab, (size, CONFIG.seq_len + 1), np.int32)}


BATCHES = [batch_of(8, seed) for seed in range(2)]


def init_fn(rng):
    return gpt.init(rng, CONFIG)


@functools.cache
def unpipelined(opt):
    """The plain GPT's 1-device step (its final state and losses) and its float64 run: what the pipelined steps
    are held to by the tolerance policy (tests/tolerance.py)."""
    trainer = jt.make_train_step(gpt.make_loss_fn(CONFIG), OPTIMIZERS[opt](), mesh=1)
    state, losses = trainer.init(init_fn(jax.random.key(0))), []
    for b in BATCHES:
        state, m = trainer(state, b)
        losses.append(float(m["loss"]))
    exact = float64_steps(gpt.make_loss_fn(CONFIG), OPTIMIZERS[opt](), init_fn(jax.random.key(0)), BATCHES)
    return jax.device_get(state), losses, exact


def pipelined(opt, axes, **kw):
    mesh = jt.make_mesh(int(np.prod(list(axes.values()))), axes=axes)
    s = STACK
    trainer = jt.make_pipeline_step(s.embed_fn, s.stage_fn, s.head_loss_fn, OPTIMIZERS[opt](), mesh=mesh,
                                    head_reads_embed=s.head_reads_embed, **kw)
    state, losses = trainer.init(init_fn=init_fn, rng=jax.random.key(0)), []
    for b in BATCHES:
        state, m = trainer(state, b)
        losses.append(float(m["loss"]))
    return trainer, state, losses


@pytest.mark.parametrize("opt,axes,kw", [
    ("adam", {"data": 1, "stage": 2}, dict(microbatches=2)),
    ("adam", {"data": 1, "stage": 4}, dict(microbatches=4)),
    ("adam", {"data": 1, "stage": 2}, dict(microbatches=2, schedule="circular", repeats=2)),
    ("adam", {"data": 1, "stage": 2}, dict(microbatches=4, schedule="circular", repeats=2, remat="full")),
    ("sgd", {"data": 2, "stage": 2}, dict(microbatches=2, remat="full")),  # sgd: the gradient's scale too
])
def test_pipelined_gpt_steps_equal_the_unpipelined_step(opt, axes, kw):
    ref, ref_losses, exact = unpipelined(opt)
    _, state, losses = pipelined(opt, axes, **kw)
    got = jax.device_get({**state.params, "stages": pipeline.layers(state.params["stages"])})
    assert_reassociated(got, ref.params, exact.params, "params", exact.start_params)
    exact_losses = [float(h["loss"]) for h in exact.history]
    assert_reassociated(losses, ref_losses, exact_losses, "losses", exact_losses[:1] * len(exact_losses))
    # The tied embedding moved, by both its uses: the policy above holds it to the plain model's move.
    start = np.asarray(exact.start_params["embed"]["wte"])
    assert np.abs(got["embed"]["wte"] - start)[:CONFIG.vocab].min(initial=np.inf) > 0
    assert np.abs(got["embed"]["wte"] - start).max() > 1e-3


def test_pipelined_gpt_evaluation_equals_the_unpipelined_one():
    trainer, state, _ = pipelined("adam", {"data": 2, "stage": 2}, microbatches=2, schedule="circular", repeats=2)
    batch = batch_of(16, 7)
    got = jt.make_eval_step(trainer.eval_fn(STACK.head_eval_fn), mesh=trainer.mesh)(state, batch)
    plain = jt.make_train_step(gpt.make_loss_fn(CONFIG), optax.sgd(0.1), mesh=1)
    plain_state = plain.init(jax.device_get({**state.params, "stages": pipeline.layers(state.params["stages"])}))
    want = jt.make_eval_step(gpt.make_eval_fn(CONFIG), mesh=1)(plain_state, batch)
    assert set(got) == set(want) and float(got["count"]) == float(want["count"]) == 16
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
    assert float(got["accuracy"]) == float(want["accuracy"]) > 0


def test_the_tied_embeddings_gradient_is_the_sum_of_its_two_uses():
    params, batch = init_fn(jax.random.key(1)), BATCHES[0]
    s = STACK

    def loss(p):
        return sequential_loss(s.embed_fn, s.stage_fn, s.head_loss_fn, head_reads_embed=True)(p, {}, batch, None)[0]

    def untied(e_in, e_out):  # the embedding's two uses as two arguments
        x = s.embed_fn(e_in, batch)
        x = jax.lax.scan(lambda x, p: (s.stage_fn(p, x), None), x, params["stages"])[0]
        return s.head_loss_fn((params["head"], e_out), x, batch)[0]

    tied = jax.jit(jax.grad(loss))(params)
    plain = jax.jit(jax.grad(lambda p: gpt.make_loss_fn(CONFIG)(p, {}, batch, None)[0]))(params)
    g_in, g_out = jax.jit(jax.grad(untied, argnums=(0, 1)))(params["embed"], params["embed"])
    for a, b in zip(jax.tree.leaves(tied), jax.tree.leaves(plain), strict=True):  # the unpipelined model's autodiff
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))
    wte_in, wte_out = np.asarray(g_in["wte"]), np.asarray(g_out["wte"])
    assert np.abs(wte_in).max() > 1e-4 and np.abs(wte_out).max() > 1e-4  # both uses count
    assert not np.asarray(g_out["wpe"]).any()  # the head reads wte only
    np.testing.assert_allclose(tied["embed"]["wte"], wte_in + wte_out, rtol=1e-5,
                               atol=1e-6 * float(np.abs(wte_in + wte_out).max()))
    np.testing.assert_allclose(tied["embed"]["wpe"], g_in["wpe"], rtol=1e-5,
                               atol=1e-6 * float(np.abs(g_in["wpe"]).max()))
    assert not tied["embed"]["wte"][CONFIG.vocab:].any()  # the padded rows: never used
