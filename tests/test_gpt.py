"""The GPT (jaxtrain.models.gpt): its shapes, causality and FLOPs, its logits and loss held to Hugging Face's
GPT-2 in PyTorch (tests/torch_gpt2.py), and its train step equal on 1 and 2 devices."""

import functools
import math
import subprocess
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxtrain as jt
from jaxtrain.models import gpt

TINY = gpt.SIZES["tiny"]


def batch_of(config, size, seed=0):
    tokens = np.random.default_rng(seed).integers(0, config.vocab, (size, config.seq_len + 1), dtype=np.int32)
    return {"tokens": tokens}


def test_the_vocabulary_is_padded_and_the_logits_keep_the_real_one():
    config = gpt.Config(vocab=250, seq_len=16, layers=2, heads=2, width=32)
    params = gpt.init(jax.random.key(0), config)
    assert params["embed"]["wte"].shape == (256, 32) and gpt.SIZES["124m"].padded_vocab == 50304
    tokens = batch_of(config, 2)["tokens"][:, :-1]
    assert gpt.apply(params, tokens, config).shape == (2, 16, 250)


def test_a_position_sees_only_the_tokens_before_it():
    params = gpt.init(jax.random.key(0), TINY)
    tokens = batch_of(TINY, 2)["tokens"][:, :-1]
    changed = tokens.copy()
    changed[:, 40:] = (changed[:, 40:] + 1) % TINY.vocab
    a, b = gpt.apply(params, tokens, TINY), gpt.apply(params, changed, TINY)
    np.testing.assert_array_equal(a[:, :40], b[:, :40])
    assert np.abs(np.asarray(a[:, 40:] - b[:, 40:])).max() > 1e-3


def test_the_loss_at_initialisation_is_near_the_uniform_ones():
    params = gpt.init(jax.random.key(0), TINY)
    loss, (_, metrics) = gpt.make_loss_fn(TINY)(params, {}, batch_of(TINY, 4), None)
    assert abs(float(loss) - np.log(TINY.vocab)) < 0.05 and set(metrics) >= {"accuracy"}


def test_parameters_and_flops_per_token_are_gpt2s():
    """GPT-2 124M: 124,439,808 parameters with the position embedding (Hugging Face's count, the embedding
    tied); nanoGPT's FLOPs per token, 6 N + 12 L T D without the position embedding."""
    config = gpt.SIZES["124m"]
    assert gpt.parameters(config) == 124_439_808
    n = 124_439_808 - 1024 * 768
    assert gpt.flops_per_token(config) == 6 * n + 12 * 12 * 1024 * 768
    shapes = jax.eval_shape(lambda rng: gpt.init(rng, TINY), jax.random.key(0))
    counted = sum(x.size for x in jax.tree.leaves(shapes)) - (TINY.padded_vocab - TINY.vocab) * TINY.width
    assert counted == gpt.parameters(TINY)


def from_hf(state: dict, config) -> dict:
    """Hugging Face GPT-2's state_dict (numpy) in the GPT's layout."""
    L, D, H = config.layers, config.width, config.heads

    def stacked(name):
        return np.stack([state[f"transformer.h.{i}.{name}"] for i in range(L)])

    wte = np.zeros((config.padded_vocab, D), np.float32)
    wte[:config.vocab] = state["transformer.wte.weight"]
    return {"embed": {"wte": wte, "wpe": state["transformer.wpe.weight"][:config.seq_len]},
            "stages": {"ln1": stacked("ln_1.weight"), "ln1_b": stacked("ln_1.bias"),
                       "qkv": stacked("attn.c_attn.weight").reshape(L, D, 3, H, D // H),
                       "qkv_b": stacked("attn.c_attn.bias").reshape(L, 3, H, D // H),
                       "proj": stacked("attn.c_proj.weight").reshape(L, H, D // H, D),
                       "proj_b": stacked("attn.c_proj.bias"), "ln2": stacked("ln_2.weight"),
                       "ln2_b": stacked("ln_2.bias"), "fc": stacked("mlp.c_fc.weight"),
                       "fc_b": stacked("mlp.c_fc.bias"), "out": stacked("mlp.c_proj.weight"),
                       "out_b": stacked("mlp.c_proj.bias")},
            "head": {"ln": state["transformer.ln_f.weight"], "ln_b": state["transformer.ln_f.bias"]}}


def test_logits_and_loss_are_hugging_faces_gpt2s(torch_python, tmp_path):
    config = gpt.Config(vocab=101, seq_len=16, layers=2, heads=4, width=32)
    made = subprocess.run([torch_python, str(Path(__file__).parent / "torch_gpt2.py"), str(tmp_path), "101", "16",
                           "2", "4", "32"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-3000:]
    with np.load(tmp_path / "state.npz") as f:
        params = from_hf(dict(f), config)
    tokens = np.load(tmp_path / "tokens.npy")
    logits = gpt.apply(params, tokens[:, :-1], config)
    want = np.load(tmp_path / "logits.npy")
    assert np.abs(np.asarray(logits) - want).max() / np.abs(want).max() < 1e-4
    loss, _ = gpt.make_loss_fn(config)(params, {}, {"tokens": tokens}, None)
    assert abs(float(loss) - float(np.load(tmp_path / "loss.npy"))) < 1e-4


BATCHES = [batch_of(TINY, 8, seed) for seed in range(2)]


def train(mesh, strategy="jit", sharding="replicated"):
    from jaxtrain.parallel import rules

    trainer = jt.make_train_step(gpt.make_loss_fn(TINY), optax.adam(1e-3), mesh=mesh, strategy=strategy,
                                 param_sharding=rules.preset(sharding, gpt.LOGICAL_AXES))
    state, history = trainer.init(gpt.init(jax.random.key(0), TINY)), []
    for batch in BATCHES:
        state, metrics = trainer(state, batch)
        history.append(jax.device_get(metrics))
    return jax.device_get(state), history


@functools.cache
def one_device():
    """The 1-device run, held to the independent reference step (tests/reference.py), and its float64 run."""
    from reference import assert_matches

    state, history = train(jt.make_mesh(1))
    exact = assert_matches(state, history, gpt.make_loss_fn(TINY), optax.adam(1e-3), gpt.init(jax.random.key(0), TINY),
                           BATCHES)
    return state, history, exact


@pytest.mark.parametrize("strategy, axes, sharding", [
    ("jit", {"data": 2}, "replicated"),
    ("shard_map", {"data": 2}, "fsdp"),
    ("ring", {"data": 2}, "replicated"),
    ("jit", {"data": 2, "model": 2}, "tp"),
])
def test_a_train_step_on_more_devices_is_the_one_device_step(strategy, axes, sharding):
    """By the tolerance policy (tests/tolerance.py): N devices re-associate the 1-device step's sums."""
    from tolerance import assert_state_reassociated

    state, history = train(jt.make_mesh(math.prod(axes.values()), axes=axes), strategy, sharding)
    assert_state_reassociated(state, history, *one_device())


def test_tensor_parallel_rules_split_heads_and_the_mlp():
    """Megatron's split: the query, key and value and the MLP's first matrix by columns (heads, hidden units),
    the attention's and the MLP's output matrices by rows; embeddings, norms and output biases replicated."""
    from jaxtrain.parallel import rules

    mesh = jt.make_mesh(4, axes={"data": 2, "model": 2})
    trainer = jt.make_train_step(gpt.make_loss_fn(TINY), optax.sgd(0.1), mesh=mesh,
                                 param_sharding=rules.preset("tp", gpt.LOGICAL_AXES))
    layout = trainer.layout(jax.eval_shape(lambda rng: gpt.init(rng, TINY), jax.random.key(0)))
    assert layout["sharded"] == {"stages/qkv": "P(None, None, None, 'model', None)",
                                 "stages/qkv_b": "P(None, None, 'model', None)",
                                 "stages/proj": "P(None, 'model', None, None)",
                                 "stages/fc": "P(None, None, 'model')", "stages/fc_b": "P(None, 'model')",
                                 "stages/out": "P(None, 'model', None)"}
