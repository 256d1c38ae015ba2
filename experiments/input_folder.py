"""``python -m experiments.input_pipeline --dataset folder:DIR``: an image folder's decode rate per worker and the
decode cores a GPU plan needs (``jaxtrain.analysis.feeding``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from jaxtrain.choices import FOLDER_PREFIX
from jaxtrain.errors import ConfigError


def rate(split, augment: str, batch: int, workers: int, batches: int) -> float:
    """Images per second of the folder's training loader with ``workers`` processes (2 warm-up batches first)."""
    from jaxtrain.data.loader import Loader

    loader = Loader(split, batch, train=True, workers=workers, augment=augment, process_index=0, process_count=1)
    it = (b for e in range(batches + 2) for b in loader.epoch(e))  # epoch after epoch: a small folder too
    try:
        for _ in range(2):
            next(it)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        return batches * batch / (time.perf_counter() - start)
    finally:
        loader.close()


def demand(args) -> tuple[float, str]:
    """(images/s one host's planned GPUs take, what they are): a saved plan, or one compiled here."""
    if args.gpu_plan:
        try:
            plan = json.loads(Path(args.gpu_plan).read_text())
            seconds = plan["estimate"]["examples_per_second"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--gpu-plan {args.gpu_plan}: not a plan of experiments.gpu_plan --json "
                              f"({type(e).__name__})") from None
        s = plan["settings"]
        return seconds / plan["hosts"], (f"each host's {plan['gpus']} x {plan['gpu']} ({s.get('model')}, "
                                         f"{s.get('precision')}, batch {plan['call_batch']}, estimated)")
    from jaxtrain import gpu

    gpu.check_plugin()
    settings = {"model": args.model, "precision": args.precision,
                **({"batch_size": args.plan_batch_size} if args.plan_batch_size else {})}
    shape = {"input_shape": (args.image_size, args.image_size, 3), "num_classes": 1000} \
        if args.model == "resnet50" else {}
    plan = gpu.plan(args.gpu, args.gpus, args.hosts, largest_batch=False,
                    progress=lambda text: print(text, file=sys.stderr, flush=True), **shape, **settings)
    return plan.estimate["examples_per_second"] / args.hosts, (f"each host's {args.gpus} x {plan.gpu} ({args.model}, "
                                                               f"{args.precision}, batch {plan.call_batch}, estimated)")


def report(args) -> int:
    from jaxtrain.analysis.feeding import Feeding
    from jaxtrain.data import folder

    if not args.dataset.startswith(FOLDER_PREFIX):
        raise ConfigError(f"--dataset {args.dataset}: this report times image folders: give folder:DIR")
    workers = args.workers or [1, 2]
    if min(workers) < 1:
        raise ConfigError("--workers: worker processes here, counts >= 1 like 1,2")
    cores = args.cores or len(os.sched_getaffinity(0))
    root = Path(args.dataset[len(FOLDER_PREFIX):])
    split = folder.load(root, args.image_size, val_fraction=None if (root / "train").is_dir() else 0.01)["train"]
    planned = demand(args) if args.gpu_plan or args.gpu else None  # a bad plan fails before the timing
    rows = [(w, rate(split, args.augment, args.batch_size, w, args.batches)) for w in workers]
    print(f"\n{args.dataset}: {len(split)} training images, {args.augment} to {args.image_size}, batch "
          f"{args.batch_size}, {len(os.sched_getaffinity(0))} cores here\n")
    print("| workers | images/s | per worker |\n|---|---|---|")
    for w, r in rows:
        print(f"| {w} | {r:,.0f} | {r / w:,.0f} |")
    per_core = rows[0][1] / rows[0][0]  # the fewest workers: each on a core of its own
    if planned:
        print("\n" + Feeding(per_core, planned[0], cores).format(planned[1]))
    return 0
