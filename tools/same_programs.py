"""Do two checkouts compile the same train steps? For refactors that must not change what runs.

    python tools/same_programs.py dump OUT.json          # in each checkout (PYTHONPATH=that checkout)
    python tools/same_programs.py compare OLD.json NEW.json

``dump`` compiles the LeNet and ResNet-18 steps of every strategy in fp32, bf16 (with scan
accumulation) and fp16, with FSDP and with optax.MultiSteps, on 2 of 4 virtual CPU devices, and
writes their optimized HLO. ``compare`` says, per step, whether the instructions are the same once
names, numbering and source locations (which move with the code) are left out.
"""

import difflib
import json
import re
import sys


def dump(path: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import optax

    import jaxtrain as jt
    from jaxtrain import models

    cases = [("lenet", s, p, k, "scan", "replicated") for s in jt.STRATEGIES
             for p, k in (("fp32", 1), ("bf16", 2), ("fp16", 1))]
    cases += [("lenet", "jit", "fp32", 1, "scan", "fsdp"), ("lenet", "shard_map", "fp32", 2, "scan", "fsdp"),
              ("lenet", "jit", "fp32", 2, "multisteps", "replicated"),
              ("resnet18", "jit", "fp32", 1, "scan", "replicated"),
              ("resnet18", "shard_map", "bf16", 2, "scan", "replicated")]
    out = {}
    for name, strategy, precision, k, accum, placement in cases:
        model = models.get(name)
        trainer = jt.make_train_step(model.loss_fn, optax.adam(1e-3), mesh=2, strategy=strategy, precision=precision,
                                     accum_steps=k, accum=accum, param_sharding=placement)
        state = trainer.init(init_fn=model.init, rng=jax.random.key(0))
        batch = model.example_batch(16 if name == "resnet18" else 64)
        out["-".join(map(str, (name, strategy, precision, k, accum, placement)))] = (
            trainer.lower(state, batch).compile().as_text())
        print(".", end="", flush=True)
    with open(path, "w") as f:
        json.dump(out, f)
    print(f" {len(out)} steps -> {path}")


def instructions(hlo: str) -> list[str]:
    hlo = re.sub(r"\.\d+\b", "", hlo)  # instruction numbering
    hlo = re.sub(r",?\s*(metadata=\{[^}]*\}|stack_frame_id=\d+)", "", hlo)  # source locations
    return [line.strip() for line in hlo.splitlines() if " = " in line]


def compare(old_path: str, new_path: str) -> int:
    with open(old_path) as f, open(new_path) as g:
        old, new = json.load(f), json.load(g)
    differ = 0
    for key in old:
        a, b = instructions(old[key]), instructions(new.get(key, ""))
        changed = sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
                      if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        differ += changed > 0
        print(f"{key:48s} {len(a):6d} vs {len(b):6d} instructions: "
              f"{'same' if not changed else f'{changed} lines differ'}")
    print("all the same" if not differ else f"{differ} of {len(old)} steps differ")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"] and len(sys.argv) == 3:
        dump(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
