"""The d2l LeNet on Fashion-MNIST, data-parallel over N devices.

    python -m experiments.lenet --devices 2

Defaults reproduce d2l's "Multiple GPUs" recipe (jaxtrain.models.MODELS):
10 epochs, global batch 256, plain SGD with lr 0.2, weights ~ N(0, 1) * 0.01.
"""

import sys

from jaxtrain.cli import main  # light: JAX is imported inside main(), after the signal handlers

if __name__ == "__main__":
    sys.exit(main("lenet", description="Train the d2l LeNet (from scratch) on Fashion-MNIST over N devices; prints "
                                       "a line per epoch and writes metrics.jsonl, summary.json and curves.png."))
