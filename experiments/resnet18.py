"""d2l's ResNet-18 (modified for 28x28) on Fashion-MNIST, data-parallel over N devices.

    python -m experiments.resnet18 --devices 2 --train-subset 10000 --epochs 1

Defaults follow d2l: 10 epochs, batch 256, lr 0.1, weights ~ N(0, 0.01^2)
(``--init he`` for He-normal). d2l's 2-GPU setting is --batch-size 512
--lr 0.2. BatchNorm is synchronised over the devices under every strategy.
"""

import sys

from jaxtrain.cli import main  # light: JAX is imported inside main(), after the signal handlers

if __name__ == "__main__":
    sys.exit(main("resnet18", description="Train d2l's ResNet-18 (3x3 stem, no max-pool, BatchNorm synchronised "
                                          "over devices) on Fashion-MNIST; writes metrics.jsonl, summary.json and "
                                          "curves.png."))
