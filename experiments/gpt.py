"""A GPT trained on text from disk, over N devices, with every strategy and sharding the image models have.

    make kjv                                   # the King James Bible as text (Debian's bible-kjv), once
    python -m experiments.gpt --devices 2 --log-every 50

Defaults: the mini GPT (4 blocks of width 256, windows of 128 tokens) on the King James Bible, a byte-level BPE
of 4096 tokens trained on its first 90% (the last 10% is the validation text), AdamW lr 1e-3 with warm-up and
cosine decay, global batch 32, one epoch. Each log line says the loss, its perplexity and tokens/s; the run ends
with its validation loss beside the validation tokens' unigram entropy and a few lines sampled from the model
(jaxtrain sample RUN_DIR, or python -m experiments.sample, samples again). docs/language-models.md.
"""

import sys

from jaxtrain.cli import main  # light: JAX is imported inside main(), after the signal handlers

if __name__ == "__main__":
    sys.exit(main("gpt", description="Train a GPT (GPT-2's decoder) on text:PATH (default: the King James Bible, "
                                     "make kjv) over N devices; prints loss, perplexity and tokens/s, ends with "
                                     "text sampled from the model; writes metrics.jsonl, summary.json, "
                                     "tokenizer.json and the model."))
