"""What the GPT's accuracy metric costs its train step on XLA:CPU: the mini GPT's jaxtrain step (one device, blocks
laid out, SGD, fp32, batch 32 x 128 tokens, jaxtrain's malloc setting) with the accuracy as ``logits.argmax(-1) ==
labels`` over the 4096 logits of each token (the models' until 2026-11-30), without any accuracy (the most a
cheaper one could save), and as the models compute it now, ``classify.ranked_first`` ("the label's logit is the
largest and no equal one comes before it": argmax's answer without argmax's (value, index) reduction). Paired:
the three take turns, their order rotating, and each ratio is the median of the per-turn ratios
(docs/language-models.md, "Where the gap is").

    .venv/bin/python tools/cpu-probes/gpt_accuracy.py [TURNS]
"""

import statistics
import sys
import time

from jaxtrain.parallel import host_memory

host_memory.keep_freed_memory()  # as a run does, before the first allocation of size

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxtrain import models  # noqa: E402
from jaxtrain.core import optim  # noqa: E402
from jaxtrain.models import classify  # noqa: E402
from jaxtrain.parallel import devices as devices_lib  # noqa: E402
from jaxtrain.train.trainer import make_train_step  # noqa: E402

CALLS = 3  # steps a turn, waited for once


def argmax_first(logits, labels):
    return logits.argmax(-1) == labels


def no_accuracy(logits, labels):
    return jnp.zeros(labels.shape, bool)


VARIANTS = {"argmax": argmax_first, "none": no_accuracy, "ranked_first": classify.ranked_first}


def main(turns: int) -> None:
    devices = devices_lib.setup_devices(1)
    mesh = devices_lib.make_mesh(devices)
    model = models.get("gpt", size="mini", input_shape=(128,), num_classes=4096, device=devices[0], unroll=True)
    batch = {"tokens": jax.random.randint(jax.random.key(1), (32, 129), 0, 4096)}
    per_example = classify.per_example
    runs = {}
    for name, correct in VARIANTS.items():
        def metrics(logits, labels, kernels="jnp", correct=correct):
            out = per_example(logits, labels, kernels)
            return {**out, "accuracy": correct(logits, labels).astype(jnp.float32)}

        classify.per_example = metrics  # read when the step is traced: its first call, below
        trainer = make_train_step(model.loss_fn, optim.make_optimizer("sgd", 0.01), mesh=mesh)
        placed = trainer.shard(batch)
        state, out = trainer.step(trainer.init(init_fn=model.init, rng=jax.random.key(0)), placed)
        jax.block_until_ready(out)
        runs[name] = [trainer, state, placed, []]
    classify.per_example = per_example
    names = list(runs)
    for turn in range(turns):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            trainer, state, placed, times = runs[name]
            start = time.perf_counter()
            for _ in range(CALLS):
                state, out = trainer.step(state, placed)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / CALLS)
            runs[name][1] = state
    ms = {name: [1000 * t for t in run[3]] for name, run in runs.items()}
    for name in names:
        print(f"{name:>14}: {statistics.median(ms[name]):7.1f} ms a step (median of {turns} turns of {CALLS})")
    for name in names[1:]:
        ratio = statistics.median(a / b for a, b in zip(ms[name], ms["argmax"]))
        print(f"paired {name}/argmax: {ratio:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
