"""Does the input pipeline keep the devices fed? LeNet epochs under loader settings, or an image folder's decode
rate and the cores a GPU plan needs.

    python -m experiments.input_pipeline [--devices 2] [--max-steps N] [--slow-ms 40]
    python -m experiments.input_pipeline --dataset folder:DIR [--workers 1,2] [--gpu h100 --gpus 8 --model resnet50
                                         --precision bf16 | --gpu-plan PLAN.json] [--cores N]

With ``--dataset folder:DIR``: the image folder's loader (``--augment``, ``--image-size``) is timed with each
worker count (processes), in images/s and per worker (one core each); then, for a GPU plan (compiled here with
``--gpu ...``: needs the gpu-compile extra, README "Planning for GPUs"; or read from ``experiments.gpu_plan
--json``), how many decode cores keep those GPUs fed and the data wait to expect with ``--cores``.

Trains the d2l LeNet on Fashion-MNIST for one epoch per setting, workers in
{0, 1, 2, 4} x prefetch in {off, 2}, and prints sec/epoch and the data-wait
percentage (time the loop waited for the next batch / epoch time). Then the
same with an artificially slow per-batch transform (``--slow-ms``), which
shows how the wait appears and how worker threads hide it.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxtrain.cli import one_line_errors, positive_int, whole_numbers


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.input_pipeline", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=positive_int, default=2, help="devices to train on")
    p.add_argument("--batch-size", type=positive_int, default=256, help="global batch size")
    p.add_argument("--workers", type=whole_numbers(0, "0,1,2,4"), default=None,
                   help="comma-separated grain worker counts (default: 0,1,2,4 threads; a folder: 1,2 processes)")
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="steps per measured epoch (default: a full epoch)")
    p.add_argument("--slow-ms", type=float, default=40.0,
                   help="sleep per batch in the slow-transform variant (0: skip the variant)")
    p.add_argument("--data-dir", default=None, help="directory with the IDX files (see experiments.lenet --help)")
    p.add_argument("--tfds-dir", default=None, help="TFDS data dir for the converted dataset")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also trace 5 steps of the slow variant starved (workers 0, prefetch off) and fed (workers "
                        "4, prefetch 2) into DIR/starved and DIR/fed (docs: Getting started, 'Watching a run')")
    f = p.add_argument_group("an image folder (--dataset folder:DIR)")
    f.add_argument("--dataset", default=None, metavar="folder:DIR", help="time this image folder's loader instead")
    f.add_argument("--image-size", type=positive_int, default=224, help="the side images are cropped and resized to")
    f.add_argument("--augment", default="rrc+flip", choices=("none", "crop+flip", "rrc+flip"),
                   help="training augmentation (as --augment of a run)")
    f.add_argument("--batches", type=positive_int, default=20, help="batches timed per worker count")
    f.add_argument("--cores", type=positive_int, default=None, help="decode cores a host has (default: this one's)")
    f.add_argument("--gpu-plan", default=None, metavar="PLAN.json", help="a plan from experiments.gpu_plan --json")
    f.add_argument("--gpu", default=None, help="compile a plan for this GPU here (h100, a100, ...; gpu-compile extra)")
    f.add_argument("--gpus", type=positive_int, default=8, help="GPUs per host of the plan")
    f.add_argument("--hosts", type=positive_int, default=1, help="hosts of the plan")
    f.add_argument("--model", default="resnet50", help="the plan's model")
    f.add_argument("--precision", default="bf16", help="the plan's precision")
    f.add_argument("--plan-batch-size", type=positive_int, default=None,
                   help="the plan's global batch (default: its recipe's)")
    return p


@one_line_errors("input_pipeline")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.dataset is not None:
        from experiments.input_folder import report

        return report(args)
    import jaxtrain as jt

    workers = args.workers or [0, 1, 2, 4]
    devices = jt.setup_devices(args.devices)
    import jax
    import optax

    from jaxtrain.data import loader, sources
    from jaxtrain.models import lenet
    from jaxtrain.train.loop import fit

    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.2), mesh=jt.make_mesh(devices))
    trainer.check_batch_size(args.batch_size)
    evaluator = jt.make_eval_step(lenet.eval_fn, mesh=trainer.mesh)
    train_split = sources.load_split("fashion_mnist", "train", data_dir=args.data_dir, tfds_dir=args.tfds_dir)
    test_split = sources.load_split("fashion_mnist", "test", data_dir=args.data_dir, tfds_dir=args.tfds_dir)

    test = loader.Loader(test_split.head(args.batch_size), args.batch_size, train=False)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    state, _, _ = fit(trainer, state, loader.Loader(train_split, args.batch_size, train=True), evaluator, test,
                      epochs=1, max_steps=5, progress=False)  # compile outside the measurements

    def slow(batch):
        time.sleep(args.slow_ms / 1000)
        return batch

    rows = []
    variants = [("none", None)] + ([(f"sleep {args.slow_ms:g} ms/batch", slow)] if args.slow_ms > 0 else [])
    for name, transform in variants:
        for w in workers:
            for prefetch in (0, 2):
                train = loader.Loader(train_split, args.batch_size, train=True, workers=w, transform=transform)
                state, history, _ = fit(trainer, state, train, evaluator, test, epochs=1, max_steps=args.max_steps,
                                        progress=False, prefetch=prefetch)
                h = history[0]
                sec_per_epoch = h.train_sec * len(train) / h.steps
                rows.append((name, w, prefetch, sec_per_epoch, 100 * h.data_wait_fraction))
                print(f"  {name:>22} workers {w} prefetch {prefetch or 'off':>3}: {sec_per_epoch:6.2f} sec/epoch, "
                      f"data wait {100 * h.data_wait_fraction:5.1f}%", file=sys.stderr, flush=True)

    if args.profile:
        from pathlib import Path

        from jaxtrain.driver.observe import Profile

        for name, w, prefetch in (("starved", 0, 0), ("fed", 4, 2)):
            profile = Profile(Path(args.profile) / name, 3, 8)  # steps 3..7
            train = loader.Loader(train_split, args.batch_size, train=True, workers=w, transform=slow)
            state, _, _ = fit(trainer, state, train, evaluator, test, epochs=1, max_steps=10, progress=False,
                              prefetch=prefetch, hooks=[profile.hook()])
            print(f"  trace of the {name} loader in {profile.log_dir}", file=sys.stderr, flush=True)

    print(f"\nLeNet, batch {args.batch_size}, {len(devices)} {devices[0].platform} devices, jax {jax.__version__}"
          f"{'' if args.max_steps is None else f', {args.max_steps} steps per epoch measured'}\n")
    print("| transform | workers | prefetch | sec/epoch | data wait |")
    print("|---|---|---|---|---|")
    for name, w, prefetch, sec, wait in rows:
        print(f"| {name} | {w} | {prefetch or 'off'} | {sec:.2f} | {wait:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
