"""A GPT: GPT-2's decoder, as plain functions over a params dict (the language-model issue's first part).

    tokens [B, T] -> token + position embeddings -> L pre-LayerNorm blocks (causal self-attention, GELU MLP,
    residuals) -> final LayerNorm -> logits [B, T, V] = x @ wte.T (the input embedding, tied)

Positions are GPT-2's learned embedding (``wpe``), or (``Config.rotary``) rotary ones: no ``wpe``, each head's
queries and keys rotated by their position (RoFormer's RoPE, its halves paired as GPT-NeoX and Llama pair them,
base 10000; ``rotate``).

GPT-2's numbers: LayerNorm eps 1e-5, GELU's tanh approximation ("gelu_new"), weights N(0, 0.02) with the
residual projections' std divided by sqrt(2 L), biases zero. The attention is ``jax.nn.dot_product_attention``
(causal): XLA's, cuDNN's fused kernel on GPUs in bf16 and fp16, and on a CPU in fp32 the same attention with its
two batched products oneDNN's (``jaxtrain.kernels.onednn_attention``) where its kernels build
(``attention_implementation``). The vocabulary's embedding is padded
to a multiple of ``Config.vocab_multiple`` rows (50257 -> 50304: matmuls of aligned shapes); the logits keep the
real vocabulary's columns only, so a padded row never takes probability.

``params = {"embed": {"wte", "wpe"}, "stages": {...}, "head": {"ln", "ln_b"}}``, each ``"stages"`` leaf the L
blocks stacked on a leading axis (one block traced, scanned L times): the shape a pipeline splits (``make_stack``,
its head reading the embedding). The
weights are laid out as Hugging Face's GPT-2 holds them (its ``Conv1D``: ``[in, out]``), the fused query, key
and value split by head (``qkv``: ``[L, D, 3, H, D/H]``) so that tensor parallelism splits heads, not the
fused matrix (``LOGICAL_AXES``: heads and the MLP's hidden units over "model", Megatron's column / row split).
A batch is ``{"tokens": int32 [B, T + 1]}``: each position predicts the next token.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.choices import GPT_SIZES
from jaxtrain.core.remat import remat as remat_block
from jaxtrain.kernels import onednn_attention
from jaxtrain.models import classify
from jaxtrain.models.model import Stack


@dataclasses.dataclass(frozen=True)
class Config:
    """One GPT's shape: ``vocab`` tokens, windows of ``seq_len``, ``layers`` blocks of ``width`` over ``heads``."""

    vocab: int = 50257
    seq_len: int = 1024
    layers: int = 12
    heads: int = 12
    width: int = 768
    mlp_ratio: int = 4
    vocab_multiple: int = 64  # the embedding's rows padded to a multiple of this
    attention: str = "xla"  # "xla"; "auto" (cuDNN's in bf16/fp16: a GPU's models); "onednn" (a CPU's, in fp32)
    unroll: bool = False  # the blocks laid out one after another, not a loop over one traced block (``blocks``)
    rotary: bool = False  # rotary positions (``rotate``), not a learned embedding

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"width {self.width} does not split into {self.heads} heads")
        if self.rotary and (self.width // self.heads) % 2:
            raise ValueError(f"rotary positions turn pairs of a head's {self.width // self.heads} values: give heads "
                             "of an even width")

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple


SIZES = {  # GPT-2's, a CPU-sized one (a few minutes of a 2-core CPU) and a tiny one for tests
    "tiny": Config(vocab=256, seq_len=64, layers=2, heads=2, width=64),
    "mini": Config(vocab=4096, seq_len=128, layers=4, heads=4, width=256),
    "124m": Config(),
    "350m": Config(layers=24, heads=16, width=1024),
    "774m": Config(layers=36, heads=20, width=1280),
}

assert {name: c.seq_len for name, c in SIZES.items()} == GPT_SIZES

# Tensor parallelism (jaxtrain.parallel.rules.LOGICAL_AXES): heads and the MLP's hidden units over "model"; the
# leading axis of a "stages" leaf is the layer.
LOGICAL_AXES = (
    (r"stages/qkv$", (None, "embed", None, "heads", None)),
    (r"stages/qkv_b$", (None, None, "heads", None)),
    (r"stages/proj$", (None, "heads", None, "embed")),
    (r"stages/fc$", (None, "embed", "mlp")),
    (r"stages/fc_b$", (None, "mlp")),
    (r"stages/out$", (None, "mlp", "embed")),
)


def init(rng: jax.Array, config: Config = SIZES["tiny"]) -> dict:
    """GPT-2's initialisation as Hugging Face's and nanoGPT's: N(0, 0.02) (both embeddings too), the residual
    projections (``proj``, ``out``) N(0, 0.02 / sqrt(2 L)), biases 0, LayerNorms 1 and 0; the padded rows of the
    embedding drawn too (they never reach a logit). Rotary positions: no ``wpe``."""
    c = config
    L, D, H, F = c.layers, c.width, c.heads, c.mlp_ratio * c.width
    k = iter(jax.random.split(rng, 6))

    def normal(*shape, std=0.02):
        return std * jax.random.normal(next(k), shape, jnp.float32)

    def zeros(*shape):
        return jnp.zeros(shape, jnp.float32)

    def ones(*shape):
        return jnp.ones(shape, jnp.float32)

    residual = 0.02 / math.sqrt(2 * L)
    return {
        "embed": {"wte": normal(c.padded_vocab, D), **({} if c.rotary else {"wpe": normal(c.seq_len, D)})},
        "stages": {"ln1": ones(L, D), "ln1_b": zeros(L, D), "qkv": normal(L, D, 3, H, D // H),
                   "qkv_b": zeros(L, 3, H, D // H), "proj": normal(L, H, D // H, D, std=residual),
                   "proj_b": zeros(L, D), "ln2": ones(L, D), "ln2_b": zeros(L, D), "fc": normal(L, D, F),
                   "fc_b": zeros(L, F), "out": normal(L, F, D, std=residual), "out_b": zeros(L, D)},
        "head": {"ln": ones(D), "ln_b": zeros(D)},
    }


def layer_norm(x, scale, bias, eps: float = 1e-5):
    """LayerNorm in fp32 (GPT-2's eps), back in ``x``'s dtype."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # float64 stays float64 (the tests' exact runs)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def embed_fn(E, batch, config: Config = SIZES["tiny"]):
    """The inputs (every token of the window but the last) -> their embeddings [B, T, D]."""
    tokens = inputs(batch)
    t = tokens.shape[1]
    if t > config.seq_len:
        raise ValueError(f"windows of {t} tokens: the GPT's positions stop at seq_len {config.seq_len}")
    return embed(E, tokens, 0, config)


def embed(E, tokens, start, config: Config):
    """Tokens [B, T] at positions ``start..start+T-1`` -> their embeddings [B, T, D] (rotary positions: the
    tokens' alone)."""
    x = jnp.take(E["wte"], tokens, axis=0)
    return x if config.rotary else x + jax.lax.dynamic_slice_in_dim(E["wpe"], start, tokens.shape[1])


def attention_inputs(p, x, positions, config: Config):
    """A block's queries, keys and values [B, T, H, C] of ``x`` [B, T, D] (tokens at ``positions`` [T]), the
    queries and keys rotated by their positions where the positions are rotary."""
    qkv = jnp.einsum("btd,dshc->sbthc", layer_norm(x, p["ln1"], p["ln1_b"]), p["qkv"])  # [3, B, T, H, C]
    q, k, v = qkv + p["qkv_b"][:, None, None]
    return (rotate(q, positions), rotate(k, positions), v) if config.rotary else (q, k, v)


ROTARY_BASE = 10000.0


def rotate(x, positions):
    """Rotary positions (RoFormer, arXiv 2104.09864) on ``x`` [B, T, H, C] at ``positions`` [T]: the pairs
    (x[i], x[i + C/2]) turned by the angle position * 10000^(-2i/C), as GPT-NeoX and Llama pair them (computed in
    fp32 or wider, back in ``x``'s dtype)."""
    c = x.shape[-1]
    wide = jnp.promote_types(x.dtype, jnp.float32)
    angle = positions.astype(wide)[:, None] * ROTARY_BASE ** (-jnp.arange(0, c, 2, dtype=wide) / c)  # [T, C/2]
    cos, sin = (f(angle)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    a, b = jnp.split(x.astype(wide), 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def block(p, x, config: Config = SIZES["tiny"]):
    """One pre-LayerNorm block: x + attention(ln1(x)), then x + mlp(ln2(x)). Its values ``qkv``, ``attention``
    and ``mlp_hidden`` are named for remat policies."""
    q, k, v = checkpoint_name(attention_inputs(p, x, jnp.arange(x.shape[1]), config), "qkv")
    how = attention_implementation(config.attention, q.dtype)
    if how == "onednn":
        att = onednn_attention.attention(q, k, v)
    elif how == "xla" and q.dtype == jnp.float16:  # XLA:CPU has no fp16 dots accumulating in fp32: attend in fp32
        att = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v)), is_causal=True,
                                           implementation=how).astype(q.dtype)
    else:
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=how)
    att = checkpoint_name(att, "attention")  # [B, T, H, C]
    x = x + jnp.einsum("bthc,hcd->btd", att, p["proj"]) + p["proj_b"]
    h = layer_norm(x, p["ln2"], p["ln2_b"]) @ p["fc"] + p["fc_b"]
    h = checkpoint_name(jax.nn.gelu(h, approximate=True), "mlp_hidden")
    return x + h @ p["out"] + p["out_b"]


FUSED_ATTENTION_CAPABILITY = (8, 0)  # cuDNN's fused (flash) attention: NVIDIA GPUs from Ampere on


def fused_attention(device) -> str | None:
    """Why cuDNN's fused attention does not run on ``device`` (a ``jax.Device``), or None where it does: a CUDA
    GPU of compute capability 8.0 or more (A100, H100, ...). A device that does not say its capability (a
    compile-only GPU target of ``jaxtrain.gpu``, all of them 8.0 or more) is taken as able."""
    if device is None or device.platform != "gpu":
        return "not a GPU"
    capability = getattr(device, "compute_capability", None)
    if capability and tuple(int(x) for x in str(capability).split(".")) < FUSED_ATTENTION_CAPABILITY:
        return f"compute capability {capability}: cuDNN's fused attention needs 8.0 or more"
    return None


def attention_implementation(choice: str, dtype) -> str:
    """``jax.nn.dot_product_attention``'s implementation: "auto" (a model built for GPUs) is cuDNN's fused kernel
    for bf16 and fp16 (its dtypes) and XLA's for fp32; "onednn" (a CPU's) is ``jaxtrain.kernels.onednn_attention``
    in fp32 (its products oneDNN's) and XLA's otherwise; "xla" is XLA's. (JAX's own ``implementation=None`` is XLA's
    everywhere in jax 0.10-0.12: it picks no cuDNN kernel by itself.)"""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if choice == "onednn":
        return "onednn" if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else "xla"
    return "cudnn" if choice == "auto" and half else "xla"


def logits(H, E, x, config: Config = SIZES["tiny"]):
    """The final LayerNorm, then the tied embedding's transpose: [B, T, vocab] (the padded rows' columns cut)."""
    x = layer_norm(x, H["ln"], H["ln_b"])
    return (x @ E["wte"].T)[..., :config.vocab]


def inputs(batch) -> jax.Array:
    return batch["tokens"][:, :-1]


def targets(batch) -> jax.Array:
    return batch["tokens"][:, 1:]


def blocks(layer, stages, x, config: Config = SIZES["tiny"]):
    """``layer(p, x)`` applied for each block's ``p`` of ``stages`` (its leaves' leading axis) in turn: a loop over
    one traced block, or (``config.unroll``) the blocks laid out one after another, the program growing with the
    layers. XLA:CPU runs the laid-out step faster (the mini GPT's: docs/language-models.md). The same math either
    way; XLA fuses the two programs differently, so where it rounds may differ (jax 0.10.2, XLA:CPU: the tiny and
    mini GPTs' fp32 gradients equal bit for bit, bf16's a few ulps apart)."""
    return jax.lax.scan(lambda x, p: (layer(p, x), None), x, stages, unroll=config.unroll)[0]


def apply(params, tokens, config: Config = SIZES["tiny"]):
    """Logits [B, T, vocab] of ``tokens`` [B, T] (position t sees tokens 0..t)."""
    x = embed_fn(params["embed"], {"tokens": jnp.pad(tokens, ((0, 0), (0, 1)))}, config)
    x = blocks(lambda p, x: block(p, x, config), params["stages"], x, config)
    return logits(params["head"], params["embed"], x, config)


def make_loss_fn(config: Config = SIZES["tiny"], remat: str = "none"):
    """``loss_fn(params, model_state, batch, key)``: the mean next-token cross-entropy over every position of the
    batch (fp32), its ``accuracy`` the share of next tokens ranked first; blocks remat'ed by the named policy."""
    layer = remat_block(lambda p, x: block(p, x, config), remat)

    def loss_fn(params, model_state, batch, key):
        x = embed_fn(params["embed"], batch, config)
        x = blocks(layer, params["stages"], x, config)
        out = logits(params["head"], params["embed"], x, config)
        loss, metrics = classify.mean_loss(out.reshape(-1, out.shape[-1]), targets(batch).reshape(-1))
        return loss, (model_state, metrics)

    return loss_fn


def make_eval_fn(config: Config = SIZES["tiny"]):
    """``eval_fn(params, model_state, batch)``: per window, its mean next-token loss and accuracy."""

    def eval_fn(params, model_state, batch):
        out = apply(params, inputs(batch), config)
        b, t, v = out.shape
        per_token = classify.per_example(out.reshape(b * t, v), targets(batch).reshape(b * t))
        return {k: jnp.mean(val.reshape(b, t), axis=1) for k, val in per_token.items()}

    return eval_fn


def make_stack(config: Config = SIZES["tiny"]) -> Stack:
    """The GPT as a pipeline's ``Stack`` (``jaxtrain.train.pipeline``): ``embed_fn``, one ``block`` a layer, and a head
    tied to the embedding (``head_reads_embed``: its fns take ``(H, E)``, the logits being ``x @ E["wte"].T``).
    ``head_loss_fn`` is ``make_loss_fn``'s loss and metrics, ``head_eval_fn`` ``make_eval_fn``'s per-window ones."""

    def stack_embed_fn(E, batch):
        return embed_fn(E, batch, config)

    def stage_fn(p, x):
        return block(p, x, config)

    def head_loss_fn(head, x, batch):
        H, E = head
        out = logits(H, E, x, config)
        return classify.mean_loss(out.reshape(-1, out.shape[-1]), targets(batch).reshape(-1))

    def head_eval_fn(head, x, batch):
        H, E = head
        out = logits(H, E, x, config)
        b, t, v = out.shape
        per_token = classify.per_example(out.reshape(b * t, v), targets(batch).reshape(b * t))
        return {k: jnp.mean(val.reshape(b, t), axis=1) for k, val in per_token.items()}

    return Stack(stack_embed_fn, stage_fn, head_loss_fn, head_eval_fn, head_reads_embed=True)


def parameters(config: Config, embeddings: bool = True) -> int:
    """Trained parameters (the embedding's real rows; ``embeddings=False``: without the position embedding, as
    nanoGPT counts for its FLOPs; rotary positions have none)."""
    c = config
    D, F = c.width, c.mlp_ratio * c.width
    per_layer = 2 * D + 3 * D * D + 3 * D + D * D + D + 2 * D + D * F + F + F * D + D
    return c.vocab * D + (c.seq_len * D if embeddings and not c.rotary else 0) + c.layers * per_layer + 2 * D


def flops_per_token(config: Config) -> float:
    """Model FLOPs of one token's forward and backward pass (PaLM's appendix B): 6 N for the weights (N without
    the position embedding) and 12 L T D for attention's scores and weighted sums."""
    return 6 * parameters(config, embeddings=False) + 12 * config.layers * config.seq_len * config.width
