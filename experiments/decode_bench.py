"""Decode + augment throughput on real photographs: jaxtrain's image-folder loader against torchvision's.

    python -m experiments.decode_bench --images DIR [--copies 3] [--size 224] [--workers 1,2]
                                       [--torch-python PY] [--dali-python PY] [--rounds 3]

DIR holds JPEGs (e.g. the 1,000 ImageNet samples of github:EliSchwartz/imagenet-sample-images, one per class);
they are linked COPIES times into a folder of class folders (nothing is copied). Both sides do the same work:
decode, a random-resized-crop to SIZE (8%-100% of the area, aspect 3/4-4/3), a horizontal flip, uint8 out.

- per image, one core: jaxtrain's ``decode`` (crop box first, only the crop of the JPEG decoded, at a reduced
  scale, one crop+resize call), the same with Pillow decoding the whole file (at the same reduced scale, then at
  full size), and torchvision's transforms on ``ImageFolder``'s image;
- loaders with W worker processes: jaxtrain's ``Loader`` (grain) and torchvision's ``DataLoader``, images/s;
  with ``--dali-python``, NVIDIA DALI's CPU pipeline with W threads too (``decode_dali.py``: its own decoder
  reads only the crop, as jaxtrain's does).

The sides alternate, round by round (``--rounds``); medians are printed. torchvision runs in its own process,
in ``--torch-python`` (default: this Python): a Python with torch and torchvision; DALI likewise.
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
from jaxtrain.cli import executable, one_line_errors, positive_int, whole_numbers

ROOT = Path(__file__).resolve().parents[1]
PER_IMAGE = (("region", "per image jaxtrain"), ("pillow", "per image jaxtrain, Pillow's whole decode (reduced)"),
             ("full", "per image jaxtrain, Pillow's full-size decode"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.decode_bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--images", required=True, help="a folder of JPEG photographs (searched recursively)")
    p.add_argument("--copies", type=positive_int, default=3, help="links to each image in the benchmark's folder")
    p.add_argument("--size", type=positive_int, default=224, help="the crop's side")
    p.add_argument("--batch", type=positive_int, default=64, help="images per batch")
    p.add_argument("--batches", type=positive_int, default=20, help="batches timed per loader measurement")
    p.add_argument("--workers", type=whole_numbers(1, "1,2"), default=[1, 2],
                   help="comma-separated worker-process counts for the loaders")
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds of both sides")
    p.add_argument("--torch-python", type=executable, default=sys.executable,
                   help="a Python with torch and torchvision")
    p.add_argument("--dali-python", type=executable,
                   help="a Python with NVIDIA DALI (nvidia-dali-cuda120): its CPU pipeline with as many threads as "
                        "--workers, side by side (default: not measured)")
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


def ours_per_image(split, how: str, n: int = 200) -> float:
    """Seconds per image of jaxtrain's rrc+flip decode on this core: ``how`` = "region" (a JPEG's crop alone,
    the default), "pillow" (Pillow's whole decode at the same reduced scale) or "full" (Pillow, full size)."""
    import numpy as np

    from jaxtrain.data import images

    root = Path(split.root)
    start = time.perf_counter()
    for i in range(n):
        rng = images._rng(0, 0, i)
        path = root / split.files[i * 7 % len(split)]
        if how != "full":
            images.decode(path, split.size, lambda w, h: images.random_resized_box(w, h, rng), bool(rng.integers(2)),
                          region=how == "region")
        else:
            from PIL import Image

            with Image.open(path) as img:
                box = images.random_resized_box(*img.size, rng)
                out = img.convert("RGB").resize((split.size, split.size), Image.BILINEAR, box=box)
                np.asarray(out.transpose(Image.FLIP_LEFT_RIGHT) if rng.integers(2) else out)
    return (time.perf_counter() - start) / n


def other_side(who: str, python: str, root: Path, size: int, batch: int, workers: int, batches: int) -> dict:
    """torchvision's (``who`` = "torch") or DALI's ("dali") measurement, in ``python``: its JSON line."""
    out = subprocess.run([python, str(ROOT / "experiments" / f"decode_{who}.py"), str(root), str(size), str(batch),
                          str(workers), str(batches)], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"decode_bench: error: the {who} side failed in {python}: "
                         f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@one_line_errors("decode_bench")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    workers = args.workers
    from jaxtrain.data import folder

    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        root = linked_folder(Path(args.images), args.copies, Path(tmp) / "train")
        linked_folder(Path(args.images), 1, Path(tmp) / "val")  # a folder's layout; the bench reads train/ only
        split = folder.load(tmp, args.size)["train"]
        cores = len(os.sched_getaffinity(0))
        rows: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for w in workers:
                t = other_side("torch", args.torch_python, root, args.size, args.batch, w, args.batches)
                rows.setdefault(f"loader torchvision, {w} worker(s)", []).append(t["loader_images_per_s"])
                if args.dali_python:
                    d = other_side("dali", args.dali_python, root, args.size, args.batch, w, args.batches)
                    rows.setdefault(f"loader dali, {w} worker(s)", []).append(d["images_per_s"])
                rows.setdefault(f"loader jaxtrain, {w} worker(s)", []).append(
                    rate(split, "rrc+flip", args.batch, w, args.batches))
            rows.setdefault("per image torchvision", []).append(1 / t["per_image_s"])
            for how, name in PER_IMAGE:
                rows.setdefault(name, []).append(1 / ours_per_image(split, how))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{len(split)} images ({args.copies} links each to the JPEGs of {args.images}), crop {args.size}, batch "
          f"{args.batch}, {cores} cores, medians of {args.rounds} alternating rounds\n")
    print("| pipeline | images/s | per worker (core) | jaxtrain / torchvision |")
    print("|---|---|---|---|")
    print(f"| one core: torchvision transforms | {med['per image torchvision']:.0f} | "
          f"{med['per image torchvision']:.0f} | |")
    for _, name in PER_IMAGE:
        label = "one core: jaxtrain" + name[len("per image jaxtrain"):]
        print(f"| {label} | {med[name]:.0f} | {med[name]:.0f} | {med[name] / med['per image torchvision']:.2f} |")
    for w in workers:
        tv, ours = med[f"loader torchvision, {w} worker(s)"], med[f"loader jaxtrain, {w} worker(s)"]
        print(f"| torchvision DataLoader, {w} worker(s) | {tv:.0f} | {tv / w:.0f} | |")
        print(f"| jaxtrain Loader, {w} worker(s) | {ours:.0f} | {ours / w:.0f} | {ours / tv:.2f} |")
        if args.dali_python:
            dali = med[f"loader dali, {w} worker(s)"]
            print(f"| DALI CPU pipeline, {w} thread(s) | {dali:.0f} | {dali / w:.0f} | {dali / tv:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
