"""Decode + augment throughput on real photographs: jaxtrain's image-folder loader against torchvision's.

    python -m experiments.decode_bench --images DIR [--copies 3] [--size 224] [--workers 1,2]
                                       [--torch-python PY] [--rounds 3]

DIR holds JPEGs (e.g. the 1,000 ImageNet samples of github:EliSchwartz/imagenet-sample-images, one per class);
they are linked COPIES times into a folder of class folders (nothing is copied). Both sides do the same work:
decode, a random-resized-crop to SIZE (8%-100% of the area, aspect 3/4-4/3), a horizontal flip, uint8 out.

- per image, one core: jaxtrain's ``decode`` (crop box first, JPEG decoded at a reduced scale, one crop+resize
  call), the same without the reduced-scale decode, and torchvision's transforms on ``ImageFolder``'s image;
- loaders with W worker processes: jaxtrain's ``Loader`` (grain) and torchvision's ``DataLoader``, images/s.

The two sides alternate, round by round (``--rounds``); medians are printed. torchvision runs in its own process,
in ``--torch-python`` (default: this Python): a Python with torch and torchvision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.input_folder import rate
from jaxtrain.cli import one_line_errors

ROOT = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.decode_bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--images", required=True, help="a folder of JPEG photographs (searched recursively)")
    p.add_argument("--copies", type=int, default=3, help="links to each image in the benchmark's folder")
    p.add_argument("--size", type=int, default=224, help="the crop's side")
    p.add_argument("--batch", type=int, default=64, help="images per batch")
    p.add_argument("--batches", type=int, default=20, help="batches timed per loader measurement")
    p.add_argument("--workers", default="1,2", help="comma-separated worker-process counts for the loaders")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of both sides")
    p.add_argument("--torch-python", default=sys.executable, help="a Python with torch and torchvision")
    return p


def linked_folder(images: Path, copies: int, where: Path) -> Path:
    """``where/CLASS/k_NAME`` links: CLASS is the name's part before "_" (ImageNet's wnid), else its stem."""
    files = sorted(p for p in images.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not files:
        raise SystemExit(f"decode_bench: error: no JPEG in {images}")
    for p in files:
        cls = where / p.stem.split("_")[0]
        cls.mkdir(parents=True, exist_ok=True)
        for k in range(copies):
            os.link(p, cls / f"{k}_{p.name}") if not (cls / f"{k}_{p.name}").exists() else None
    return where


def ours_per_image(split, reduced: bool, n: int = 200) -> float:
    """Seconds per image of jaxtrain's rrc+flip decode on this core (``reduced``: at a reduced JPEG scale)."""
    import numpy as np

    from jaxtrain.data import images

    root = Path(split.root)
    start = time.perf_counter()
    for i in range(n):
        rng = images._rng(0, 0, i)
        if reduced:
            images.decode(root / split.files[i * 7 % len(split)], split.size,
                          lambda w, h: images.random_resized_box(w, h, rng), bool(rng.integers(2)))
        else:
            from PIL import Image

            with Image.open(root / split.files[i * 7 % len(split)]) as img:
                box = images.random_resized_box(*img.size, rng)
                out = img.convert("RGB").resize((split.size, split.size), Image.BILINEAR, box=box)
                np.asarray(out.transpose(Image.FLIP_LEFT_RIGHT) if rng.integers(2) else out)
    return (time.perf_counter() - start) / n


def torch_side(python: str, root: Path, size: int, batch: int, workers: int, batches: int) -> dict:
    out = subprocess.run([python, str(ROOT / "experiments" / "decode_torch.py"), str(root), str(size), str(batch),
                          str(workers), str(batches)], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"decode_bench: error: torchvision's side failed in {python}: "
                         f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@one_line_errors("decode_bench")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    from jaxtrain.data import folder

    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        root = linked_folder(Path(args.images), args.copies, Path(tmp) / "train")
        split = folder.load(root, args.size, val_fraction=0.01)["train"]
        cores = len(os.sched_getaffinity(0))
        rows: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for w in workers:
                t = torch_side(args.torch_python, root, args.size, args.batch, w, args.batches)
                rows.setdefault(f"loader torchvision, {w} worker(s)", []).append(t["loader_images_per_s"])
                rows.setdefault(f"loader jaxtrain, {w} worker(s)", []).append(
                    rate(split, "rrc+flip", args.batch, w, args.batches))
            rows.setdefault("per image torchvision", []).append(1 / t["per_image_s"])
            rows.setdefault("per image jaxtrain", []).append(1 / ours_per_image(split, True))
            rows.setdefault("per image jaxtrain, full-size decode", []).append(1 / ours_per_image(split, False))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{len(split)} images ({args.copies} links each to the JPEGs of {args.images}), crop {args.size}, batch "
          f"{args.batch}, {cores} cores, medians of {args.rounds} alternating rounds\n")
    print("| pipeline | images/s | per worker (core) | jaxtrain / torchvision |")
    print("|---|---|---|---|")
    print(f"| one core: torchvision transforms | {med['per image torchvision']:.0f} | "
          f"{med['per image torchvision']:.0f} | |")
    for name in ("per image jaxtrain", "per image jaxtrain, full-size decode"):
        label = "one core: jaxtrain" + name[len("per image jaxtrain"):]
        print(f"| {label} | {med[name]:.0f} | {med[name]:.0f} | {med[name] / med['per image torchvision']:.2f} |")
    for w in workers:
        tv, ours = med[f"loader torchvision, {w} worker(s)"], med[f"loader jaxtrain, {w} worker(s)"]
        print(f"| torchvision DataLoader, {w} worker(s) | {tv:.0f} | {tv / w:.0f} | |")
        print(f"| jaxtrain Loader, {w} worker(s) | {ours:.0f} | {ours / w:.0f} | {ours / tv:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
