"""What a language model's run says that an image model's does not: perplexity and tokens/s in its lines, the
unigram entropy of its validation tokens (the loss a model that ignores the context cannot beat), and a few lines
sampled from it when it ends (``jaxtrain.models.generate``), and again from its saved files (``jaxtrain sample``)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import jax
import numpy as np

from jaxtrain.errors import ConfigError, named

log = logging.getLogger(__name__)


def perplexity(loss: float) -> str:
    """``"ppl 61.8"``: exp of a mean next-token loss in nats (``inf`` past exp's range)."""
    return f"ppl {math.exp(loss):,.1f}" if loss < 700 else "ppl inf"


def epoch_words(e, seq_len: int) -> str:
    """An epoch's line after its number: losses with their perplexities, next-token accuracy and tokens/s."""
    test = f"test loss {e.test_loss:.4f} ({perplexity(e.test_loss)})" if e.test_examples else "not evaluated"
    tokens_per_sec = e.examples * seq_len / max(e.train_sec, 1e-9)
    return (f"train loss {e.train_loss:.4f} ({perplexity(e.train_loss)}), next-token acc {e.train_acc:.3f}, {test}, "
            f"{tokens_per_sec:,.0f} tokens/s")


def targets(split) -> np.ndarray:
    """The tokens an evaluation of ``split`` predicts: each window's (starting at i * seq_len) but its first."""
    return np.asarray(split.tokens[1:len(split) * split.seq_len + 1])


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """The entropy (nats) of the tokens' own frequencies: the mean loss of the best model that ignores the
    context, measured on these tokens (a lower bound such a model cannot beat on them)."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def summary(model, test_split, summary: dict) -> dict:
    """What summary.json adds for a language model: tokens/s, the test perplexity and the validation tokens'
    unigram entropy (nats) beside the test loss; its program's choices (its positions, the attention it runs, its
    blocks laid out or a loop: ``models.get``'s for the run's devices)."""
    return {"tokens_per_sec": summary["examples_per_sec"] * model.seq_len,
            "test_perplexity": math.exp(min(summary["test_loss"], 700.0)),
            "unigram_entropy": unigram_entropy(targets(test_split), model.num_classes),
            "seq_len": model.seq_len, "vocab": model.num_classes,
            "positions": "rotary" if model.config.rotary else "learned",
            "attention": attention(model, summary["precision"]),
            "blocks": "unrolled" if model.config.unroll else "loop"}


def attention(model, precision: str) -> str:
    """The attention ``model``'s program runs in ``precision`` (``gpt.attention_implementation``): "cudnn",
    "onednn" (XLA's with oneDNN's products, a CPU's) or "xla"."""
    from jaxtrain.core.precision import get_policy
    from jaxtrain.models.gpt import attention_implementation

    return attention_implementation(model.config.attention, get_policy(precision).compute_dtype)


def trained(run_dir: str | Path):
    """(model, params, tokenizer) of a finished language-model run (its ``--out``); one line each for a run that
    is not a language model's, or has no tokenizer."""
    from jaxtrain.data import text
    from jaxtrain.driver import export
    from jaxtrain.models import LanguageModel

    meta = export.info(run_dir)
    model = export.model_of(meta)
    if not isinstance(model, LanguageModel):
        raise ConfigError(f"{named('run_dir', run_dir)}: holds a {meta['model']} model, not a language model (train "
                          "one with jaxtrain gpt or python -m experiments.gpt)")
    tokenizer = Path(run_dir) / export.TOKENIZER
    if not tokenizer.is_file():
        raise ConfigError(f"{named('run_dir', run_dir)}: has no {export.TOKENIZER} (a language-model run writes it "
                          "when it finishes); train it again")
    _, params, _ = export.load(run_dir)
    return model, params, text.load_tokenizer(tokenizer, of_run=named("run_dir", run_dir))  # the run's own file


def samples(model, params, tokenizer, prompts: list[str], new_tokens: int, *, seed: int = 0,
            temperature: float = 0.8, top_k: int | None = 40) -> list[str]:
    """Each prompt continued by ``new_tokens`` tokens sampled from ``model`` (a ``LanguageModel``): the text, prompt
    included; a prompt longer than half the model's context keeps its end, and the text stops at the context."""
    from jaxtrain.models import generate

    config = model.config
    out, said = [], False
    for i, prompt in enumerate(prompts):
        ids = np.asarray(tokenizer.encode(prompt), np.int32)[-max(1, config.seq_len // 2):]  # room to go on
        n = min(new_tokens, config.seq_len - len(ids))
        if n < new_tokens and not said:
            said = True
            log.warning(f"the text stops at the model's context of {config.seq_len} tokens: {n} new tokens after "
                        f"the prompt's {len(ids)}, not {new_tokens}")
        tokens = generate.generate(params, config, ids[None], n, key=jax.random.key(seed + i),
                                   temperature=temperature, top_k=top_k and min(top_k, config.vocab))
        out.append(tokenizer.decode(np.asarray(tokens[0])))
    return out


def sample_prompts(split, tokenizer, count: int = 3, length: int = 8) -> list[str]:
    """``count`` prompts from the validation text: the first ``length`` tokens of windows spread over it."""
    n = len(split)
    idx = np.linspace(0, n - 1, count).astype(int)
    windows = split.rows(idx, train=False, augment=None, seed=0, epoch=0)[0]["tokens"]
    return [tokenizer.decode(w[:length]) for w in windows]
