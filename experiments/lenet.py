"""The d2l LeNet on Fashion-MNIST, data-parallel over N devices.

    python -m experiments.lenet --devices 2

Defaults reproduce d2l's "Multiple GPUs" recipe: 10 epochs, global batch 256,
plain SGD with lr 0.2, weights ~ N(0, 1) * 0.01.
"""

from __future__ import annotations

import sys

from jaxtrain.experiment import Model, main, make_parser  # light: JAX is imported inside main()


def model(args) -> Model:
    from jaxtrain.models import lenet

    return Model(
        name="lenet",
        init=lambda rng: (lenet.init_params(rng), {}),
        loss_fn=lenet.make_loss_fn(args.remat),
        eval_fn=lenet.eval_fn,
        apply=lenet.apply,
        tp_rules=lenet.TP_RULES,
    )


def parser():
    return make_parser(
        "python -m experiments.lenet",
        "Train the d2l LeNet (from scratch) on Fashion-MNIST over N devices; "
        "prints a line per epoch and writes metrics.jsonl, summary.json and curves.png.",
        epochs=10,
        batch_size=256,
        lr=0.2,
    )


if __name__ == "__main__":
    sys.exit(main(parser, model))
