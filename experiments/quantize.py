"""Post-training int8 quantisation of a finished run (LeNet or ResNet-18), measured on the full test set.

    python -m experiments.quantize --run RUN_DIR [--json FILE]

RUN_DIR is a finished run's --out directory (it holds model/ and model.json).
Weights int8 with a scale per output channel, activations int8 with a scale
per example (dynamic), int8 x int8 -> int32 convolutions and dots (counted in
the compiled program) via qwix. Prints fp32 vs int8 test accuracy, argmax
agreement, parameter bytes and inference ms per batch on one device: each
program as fast as jaxtrain compiles it on this CPU (fp32 under jaxtrain's
CPU flags, like training; int8 with ``compat.int8_compiler_options``).
"""

from __future__ import annotations

import argparse
import sys

from experiments import print_and_save
from jaxtrain.cli import positive_int, whole_numbers


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.quantize", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", required=True, help="a finished run's --out directory (holds model/ and model.json)")
    p.add_argument("--data-dir", default=None, help="the dataset's files, if the run was given --data-dir")
    p.add_argument("--tfds-dir", default=None, help="TFDS data dir of the converted dataset (as for the run)")
    p.add_argument("--test-subset", type=positive_int, default=None, help="the first N test examples only (smoke runs)")
    p.add_argument("--batch-sizes", type=whole_numbers(1, "1,256"), default="1,256",
                   help="inference batch sizes to time (ms per batch)")
    p.add_argument("--repeats", type=positive_int, default=20, help="timed calls per batch size (median reported)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p


def _predictions(fn, images, batch: int = 500):
    import numpy as np

    return np.concatenate([np.asarray(fn(images[i:i + batch])).argmax(-1) for i in range(0, len(images), batch)])


def _run_data_dir(run: str) -> str | None:
    """The --data-dir the run was trained with (its summary.json's data_source), or None for the default data."""
    import json
    from pathlib import Path

    try:
        source = json.loads((Path(run) / "summary.json").read_text()).get("data_source")
    except (OSError, ValueError):
        return None
    return source if source not in (None, "default") and Path(source).is_dir() else None


def measure(args) -> dict:
    import jaxtrain as jt
    from jaxtrain.core import compat

    if not compat.backend_started():  # from the command line: jaxtrain's CPU flags, as a run (fp32 at its fastest)
        jt.setup_devices(1)  # the int8 program sets its own options
    import jax
    import numpy as np

    from jaxtrain.analysis import quantize
    from jaxtrain.data import loader, sources
    from jaxtrain.driver import export
    from jaxtrain.errors import ConfigError
    from jaxtrain.train.timing import median_seconds

    meta, params, model_state = export.load(args.run, quantize.MODELS)
    dataset = meta["settings"]["dataset"]
    if dataset.startswith("folder:"):
        raise ConfigError(f"{args.run} trained on an image folder ({dataset}): experiments.quantize evaluates runs "
                          "of the in-memory datasets only (fashion_mnist, mnist, cifar10, tfds:NAME)")
    # The run's own data (its --data-dir, from summary.json) unless given; never a download (minutes, then a failure
    # when offline): data not found is a one-line error saying to pass --data-dir.
    test = sources.load_split(dataset, "test", data_dir=args.data_dir or _run_data_dir(args.run),
                              tfds_dir=args.tfds_dir, download=False).head(args.test_subset)
    images = loader.normalise(test.images)
    q = quantize.quantize(meta, params, model_state)
    fp32, int8 = _predictions(q.fp32, images), _predictions(q.int8, images)
    ops = quantize.integer_ops(q.compiled_text(images[:8]))
    out = {"model": meta["model"], "run": str(args.run), "dataset": dataset, "test_examples": len(test),
           "fp32_acc": float((fp32 == test.labels).mean()), "int8_acc": float((int8 == test.labels).mean()),
           "argmax_agreement": float((fp32 == int8).mean()), "fp32_param_bytes": q.fp32_param_bytes,
           "int8_param_bytes": q.int8_param_bytes, "int8_convolutions": ops["convolution"], "int8_dots": ops["dot"],
           "int8_operands": ops["s8"],
           "ms_per_batch": {}, "device": jax.devices()[0].device_kind, "cpu_isa": compat.cpu_isa(),
           "jax": jax.__version__}
    for b in args.batch_sizes:
        x = jax.device_put(np.resize(images, (b, *images.shape[1:])))
        out["ms_per_batch"][b] = {k: 1e3 * median_seconds(lambda f=f: f(x).block_until_ready(), args.repeats)
                                  for k, f in (("fp32", q.fp32), ("int8", q.int8))}
    return out


def table(r: dict) -> str:
    lines = [f"{r['model']} ({r['run']}), {r['test_examples']} test examples of {r['dataset']}; {r['device']} "
             f"({r['cpu_isa'] or 'ISA unknown'}), "
             f"jax {r['jax']}; int8 program: {r['int8_convolutions']} integer convolutions, "
             f"{r['int8_dots']} integer dots ({r['int8_operands']} of them on int8 operands)",
             "", "| | fp32 | int8 | int8 / fp32 |", "|---|---|---|---|",
             f"| test accuracy | {r['fp32_acc']:.4f} | {r['int8_acc']:.4f} | {r['int8_acc'] - r['fp32_acc']:+.4f} |",
             f"| argmax agreement | | {r['argmax_agreement']:.4f} | |",
             f"| parameter bytes | {r['fp32_param_bytes']:,} | {r['int8_param_bytes']:,} | "
             f"{r['int8_param_bytes'] / r['fp32_param_bytes']:.3f} |"]
    for b, t in r["ms_per_batch"].items():
        lines.append(f"| ms per batch of {b} | {t['fp32']:.3f} | {t['int8']:.3f} | {t['int8'] / t['fp32']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from jaxtrain.cli import library_log
    from jaxtrain.errors import ConfigError

    try:
        with library_log({"run_dir": "--run"}):  # the library's lines and errors, as this command line says them
            result = measure(args)
    except ConfigError as e:
        print(f"quantize: error: {e}", file=sys.stderr)
        return 2
    return print_and_save(table(result), result, args.json)


if __name__ == "__main__":
    sys.exit(main())
