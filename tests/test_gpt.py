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
from jaxtrain.pretrained import gpt2

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


HF = gpt.Config(vocab=101, seq_len=16, layers=2, heads=4, width=32)


def reference(torch_python, *args):
    """tests/torch_gpt2.py with ``args`` for the HF config's shape, in the torch venv."""
    shape = [str(x) for x in (HF.vocab, HF.seq_len, HF.layers, HF.heads, HF.width)]
    done = subprocess.run([torch_python, str(Path(__file__).parent / "torch_gpt2.py"), args[0], str(args[1]), *shape,
                           *map(str, args[2:])], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def made(torch_python, tmp_path_factory):
    """A random Hugging Face GPT-2 (tests/torch_gpt2.py make): its files, tokens, logits and loss."""
    out = tmp_path_factory.mktemp("gpt2")
    reference(torch_python, "make", out)
    return out


def test_logits_and_loss_are_hugging_faces_gpt2s(made):
    """Its model.safetensors (save_pretrained's) loaded by jaxtrain.pretrained.gpt2: the same logits and loss."""
    params = gpt2.load(made / "hf" / "model.safetensors", HF)
    tokens = np.load(made / "tokens.npy")
    want = np.load(made / "logits.npy")
    assert np.abs(np.asarray(gpt.apply(params, tokens[:, :-1], HF)) - want).max() / np.abs(want).max() < 1e-4
    loss, _ = gpt.make_loss_fn(HF)(params, {}, {"tokens": tokens}, None)
    assert abs(float(loss) - float(np.load(made / "loss.npy"))) < 1e-4


def test_exported_weights_load_into_transformers_strictly_with_the_same_logits(made, torch_python, tmp_path):
    params = gpt.init(jax.random.key(3), HF)
    path = gpt2.save(params, HF, tmp_path / "mine.safetensors")
    reference(torch_python, "check", made, path)
    tokens = np.load(made / "tokens.npy")
    want = np.asarray(gpt.apply(params, tokens[:, :-1], HF))
    assert np.abs(np.load(made / "checked.npy") - want).max() / np.abs(want).max() < 1e-4


def test_a_file_of_another_shape_or_model_is_one_line(made, tmp_path):
    from jaxtrain.errors import ConfigError
    from jaxtrain.pretrained import tensors

    with pytest.raises(ConfigError, match=r"h\.0\.ln_1\.weight is \[32\], this GPT needs \[64\]"):
        gpt2.load(made / "hf" / "model.safetensors", gpt.Config(vocab=101, seq_len=16, layers=2, heads=4, width=64))
    with pytest.raises(ConfigError, match="wpe.weight holds 17 positions, this GPT needs seq_len=32"):
        gpt2.load(made / "hf" / "model.safetensors", gpt.Config(vocab=101, seq_len=32, layers=2, heads=4, width=32))
    whole = tensors.read(made / "hf" / "model.safetensors")
    tensors.write({**whole, "transformer.h.0.attn.q_norm.weight": np.ones(8, np.float32)}, tmp_path / "x.safetensors")
    with pytest.raises(ConfigError, match="1 tensor\\(s\\) this GPT does not compute: h.0.attn.q_norm.weight"):
        gpt2.load(tmp_path / "x.safetensors", HF)
    tensors.write({k: v for k, v in whole.items() if "ln_f" not in k}, tmp_path / "y.safetensors")
    with pytest.raises(ConfigError, match="no tensor ln_f.weight"):
        gpt2.load(tmp_path / "y.safetensors", HF)


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
