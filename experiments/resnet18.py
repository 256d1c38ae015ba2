"""d2l's ResNet-18 (modified for 28x28) on Fashion-MNIST, data-parallel over N devices.

    python -m experiments.resnet18 --devices 2 --train-subset 10000 --epochs 1

Defaults follow d2l: 10 epochs, batch 256, lr 0.1, weights ~ N(0, 0.01^2).
d2l's 2-GPU setting is --batch-size 512 --lr 0.2. BatchNorm is synchronised
over the devices under every strategy.
"""

from __future__ import annotations

import sys

from jaxtrain.experiment import Model, main, make_parser  # light: JAX is imported inside main()


def model(args) -> Model:
    from jaxtrain.models import resnet

    net = resnet.ResNet18(weight_init=args.init, remat=args.remat)
    eval_net = resnet.ResNet18(weight_init=args.init)
    return Model(
        name="resnet18",
        init=lambda rng: resnet.init_variables(rng, eval_net),
        loss_fn=resnet.make_loss_fn(net),
        eval_fn=resnet.make_eval_fn(eval_net),
        tp_rules=resnet.TP_RULES,
    )


def parser():
    p = make_parser(
        "python -m experiments.resnet18",
        "Train d2l's ResNet-18 (3x3 stem, no max-pool, BatchNorm synchronised over devices) on Fashion-MNIST; "
        "writes metrics.jsonl, summary.json and curves.png.",
        epochs=10,
        batch_size=256,
        lr=0.1,
    )
    p.add_argument("--init", choices=("d2l", "he"), default="d2l",
                   help="conv/dense weight init: d2l's N(0, 0.01^2) or He-normal")
    return p


if __name__ == "__main__":
    sys.exit(main(parser, model))
