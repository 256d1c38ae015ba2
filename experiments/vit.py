"""A small Vision Transformer on Fashion-MNIST: data parallel, or pipelined over a "stage" mesh axis.

    python -m experiments.vit --devices 4                                   # data parallel
    python -m experiments.vit --devices 4 --mesh stage=4 --microbatches 8   # GPipe over 4 stages
    python -m experiments.vit --devices 4 --mesh stage=2 --microbatches 4 --pipeline-schedule circular --repeats 2

Recipe (jaxtrain.models.MODELS["vit"]): 3 epochs, global batch 64, Adam lr 1e-3.
"""

import sys

from jaxtrain.cli import main  # light: JAX is imported inside main(), after the signal handlers

if __name__ == "__main__":
    sys.exit(main("vit", description="Train a small Vision Transformer (8 blocks) on Fashion-MNIST, data parallel "
                                     "or pipelined (--mesh stage=N --microbatches M "
                                     "[--pipeline-schedule circular --repeats R]); prints a line per epoch and writes "
                                     "metrics.jsonl, summary.json, curves.png."))
