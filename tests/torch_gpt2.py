"""The PyTorch side of tests/test_gpt.py, run in a Python with torch and transformers (``make torch-venv``).
Never imported by pytest.

    python tests/torch_gpt2.py make DIR VOCAB SEQ LAYERS HEADS WIDTH
    python tests/torch_gpt2.py check DIR VOCAB SEQ LAYERS HEADS WIDTH FILE
    python tests/torch_gpt2.py rope DIR
    python tests/torch_gpt2.py neox DIR VOCAB SEQ LAYERS HEADS WIDTH

Hugging Face's ``GPT2LMHeadModel`` for that shape (SEQ + 1 positions: the loss reads a whole window), randomly
initialised (seed 0; every LayerNorm's scale and bias and every bias drawn at random too, so nothing is the
identity), dropout off: its ``state_dict`` as
DIR/state.npz, a random window of SEQ + 1 tokens per example as DIR/tokens.npy, the logits of the first SEQ
positions as DIR/logits.npy and its loss (``labels=tokens``: each position predicts the next) as DIR/loss.npy;
and the model as transformers saves it (``save_pretrained``: DIR/hf/model.safetensors, config.json). ``check``:
FILE (safetensors) loaded into that model (SEQ positions) with ``load_state_dict(strict=True)``: its logits on the
first SEQ tokens of DIR/tokens.npy as DIR/checked.npy. ``rope``: the queries and keys of DIR/qk.npz (``q``,
``k`` [B, T, H, C], ``positions`` [T]) turned by Hugging Face's rotary embedding (Llama's: ``LlamaRotaryEmbedding``,
base 10000, and ``apply_rotary_pos_emb``) as DIR/turned.npz. ``neox``: Hugging Face's ``GPTNeoXForCausalLM`` set
up as jaxtrain's rotary GPT (rotary positions on the whole head, base 10000; sequential residuals; GELU's tanh
approximation; biases; the output layer tied to the embedding), randomly initialised as ``make`` does: its
``state_dict`` as DIR/state.npz, a random window per example as DIR/tokens.npy, its logits as DIR/logits.npy.
"""

import sys
from pathlib import Path

import numpy as np


def main(argv):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    command, out = argv[0], Path(argv[1])
    if command == "rope":
        return rope(out)
    if command == "neox":
        return neox(out, *map(int, argv[2:7]))
    vocab, seq, layers, heads, width = map(int, argv[2:7])
    torch.manual_seed(0)
    positions = seq if command == "check" else seq + 1  # jaxtrain's GPT holds seq; the loss reads seq + 1 tokens
    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    if command == "check":
        from safetensors.torch import load_file

        model.load_state_dict(load_file(argv[7]), strict=True)
        with torch.no_grad():
            logits = model(torch.from_numpy(np.load(out / "tokens.npy")[:, :seq]).long()).logits
        np.save(out / "checked.npy", logits.numpy())
        return 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    tokens = torch.randint(0, vocab, (3, seq + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        result = model(tokens, labels=tokens)
    np.savez(out / "state.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    model.save_pretrained(out / "hf")
    np.save(out / "tokens.npy", tokens.numpy().astype(np.int32))
    np.save(out / "logits.npy", result.logits[:, :seq].numpy())
    np.save(out / "loss.npy", result.loss.numpy())
    return 0


def neox(out: Path, vocab: int, seq: int, layers: int, heads: int, width: int) -> int:
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=4 * width, hidden_act="gelu_new", max_position_embeddings=seq,
                           layer_norm_eps=1e-5, use_parallel_residual=False, attention_bias=True,
                           tie_word_embeddings=True, hidden_dropout=0.0, attention_dropout=0.0,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 1.0})
    model = GPTNeoXForCausalLM(config).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as jaxtrain's
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
            elif "query_key_value" in name:  # sharp attention: where a key stands must change the logits
                p.mul_(20.0)
        tokens = torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(1))
        logits = model(tokens).logits
    np.savez(out / "state.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    np.save(out / "tokens.npy", tokens.numpy().astype(np.int32))
    np.save(out / "logits.npy", logits.numpy())
    return 0


def rope(out: Path) -> int:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    given = np.load(out / "qk.npz")
    q, k = (torch.from_numpy(given[name]).transpose(1, 2) for name in ("q", "k"))  # Llama's [B, H, T, C]
    heads, width = q.shape[1], q.shape[1] * q.shape[3]
    config = LlamaConfig(hidden_size=width, num_attention_heads=heads, max_position_embeddings=4096,
                         rope_theta=10000.0)
    positions = torch.from_numpy(given["positions"]).long()[None].expand(q.shape[0], -1)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    turned = apply_rotary_pos_emb(q, k, cos, sin)
    np.savez(out / "turned.npz", **{name: t.transpose(1, 2).numpy() for name, t in zip(("q", "k"), turned)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
