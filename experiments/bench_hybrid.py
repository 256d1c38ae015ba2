"""What crosses the process boundary per step on a hybrid mesh: replicated, fsdp, zero1 and hsdp, measured from
the compiled program against theory.

    python -m experiments.bench_hybrid [--model resnet18] [--replicas 2] [--devices 4] [--strategy shard_map]

The mesh is replica=R (across processes: the network) x data=N/R (within one: NVLink, or here shared memory).
One process stands in for R of them: the program XLA compiles is the same, and a collective crosses processes
where its device group spans replicas (``jaxtrain.analysis.diagnostics.crossing_bytes``). Bytes are the buffers the
collectives work on, as ``compiled_stats`` counts them (a ring moves about (n-1)/n of an all-gather's or a
reduce-scatter's, 2(n-1)/n of an all-reduce's). Theory, for G gradient bytes of which fsdp/hsdp shard S:

    replicated  all-reduce G across                                  (every gradient crosses)
    fsdp        all-gather S + reduce-scatter S + all-reduce (G - S) across
    zero1       reduce-scatter S + all-gather S + all-reduce (G - S) across (ZeRO-1/2: an all-reduce's bytes)
    hsdp        all-reduce S / (N/R) + (G - S) across; the gather and the scatter of S stay within a process

plus what is averaged beside the gradients: the loss, the metrics and the model state (BatchNorm statistics).
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxtrain.cli import one_line_errors, positive_int

LAYOUTS = ("replicated", "fsdp", "zero1", "hsdp")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_hybrid", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("lenet", "resnet18", "vit"), default="lenet", help="the model")
    p.add_argument("--devices", type=positive_int, default=4, help="devices in all")
    p.add_argument("--replicas", type=positive_int, default=2, help="replicas (processes) the devices split into")
    p.add_argument("--batch-size", type=positive_int, default=64, help="GLOBAL batch size")
    p.add_argument("--strategy", choices=("jit", "explicit", "shard_map"), default="shard_map",
                   help="shard_map places every collective itself; jit and explicit leave them to XLA")
    p.add_argument("--gpu", default=None, help="compile for this GPU's nodes instead (h100, ...; compile-only: "
                   "--replicas hosts of --devices/--replicas GPUs; needs the gpu-compile extra)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    return p


def theory(layout: str, grads: int, sharded: int, inner: int, extra: int) -> dict:
    """Bytes across processes per kind, as the module's docstring gives them (``extra``: what is averaged beside
    the gradients)."""
    rest = grads - sharded + extra
    return {"replicated": {"all-reduce": grads + extra},
            "fsdp": {"all-gather": sharded, "reduce-scatter": sharded, "all-reduce": rest},
            "zero1": {"all-gather": sharded, "reduce-scatter": sharded, "all-reduce": rest},
            "hsdp": {"all-reduce": sharded // inner + rest}}[layout]


@one_line_errors("bench_hybrid")
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import jaxtrain as jt

    if args.devices % args.replicas or args.replicas < 2:
        raise jt.ConfigError(f"--replicas {args.replicas}: at least 2, dividing --devices {args.devices}")
    inner = args.devices // args.replicas
    axes = {"replica": args.replicas, "data": inner}
    if args.gpu:
        from jaxtrain import gpu

        mesh = gpu.mesh_for(args.gpu, inner, hosts=args.replicas, axes=axes)
    else:
        mesh = jt.make_mesh(jt.setup_devices(args.devices), axes)
    import jax
    import optax

    from jaxtrain import models
    from jaxtrain.analysis.diagnostics import collective_bytes, crossing_bytes, replica_hosts
    from jaxtrain.parallel import rules, sharding

    model = models.get(args.model)
    variables = jax.eval_shape(model.init, jax.random.key(0))  # shapes: a step compiles from them (GPU too)
    batch = model.batch_shapes(args.batch_size)

    def nbytes(x):
        return x.size * x.dtype.itemsize

    grads = sum(nbytes(x) for x in jax.tree.leaves(variables[0]))
    # Averaged beside the gradients: the loss and the loss_fn's metrics, and the model state (BatchNorm).
    _, (model_state, metrics) = jax.eval_shape(model.loss_fn, *variables, batch, jax.random.key(0))
    extra = 4 * (1 + len(metrics)) + sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model_state))
    rows = {}
    for layout in LAYOUTS:
        trainer = jt.make_train_step(model.loss_fn, optax.adam(1e-3), mesh=mesh, strategy=args.strategy,
                                     param_sharding=layout)
        state = trainer.abstract_state(init_fn=model.init)
        text = trainer.lower(state, batch).compile().as_text()
        specs = rules.param_specs(variables[0], "fsdp" if layout == "zero1" else layout, mesh)
        sharded = sum(nbytes(x) for x, s in zip(jax.tree.leaves(variables[0]), jax.tree.leaves(
            specs, is_leaf=sharding.is_spec)) if any(e is not None for e in s))
        rows[layout] = {"sharded": sharded, "across": crossing_bytes(text, replica_hosts(mesh)),
                        "every": collective_bytes(text), "state_bytes": sharding.device_bytes(state)}
        rows[layout]["theory"] = theory(layout, grads, sharded, inner, extra)
        print(f"compiled {layout}", file=sys.stderr, flush=True)

    def mib(b):
        return f"{b / 2**20:10.3f}"

    def total(row, key):  # bytes of the collectives under row[key]
        return sum(v["bytes"] if isinstance(v, dict) else v for v in row[key].values())

    where = (f"{args.replicas} x {inner} {args.gpu.upper()} (compiled here)" if args.gpu
             else f"{args.devices} CPU devices")
    print(f"{args.model}, {args.strategy}, {where}, mesh replica={args.replicas} x data={inner}: per step, the bytes "
          f"that cross processes (MiB; theory in brackets); gradients G = {grads / 2**20:.3f} MiB; state: per device, "
          "with Adam's")
    print(f"{'layout':>10} {'state MiB':>10} {'across MiB':>10} "
          + " ".join(f"{k:>26}" for k in ("all-reduce", "all-gather", "reduce-scatter")))
    for layout, row in rows.items():
        cells = [f"{mib(row['across'].get(k, {}).get('bytes', 0))} [{mib(row['theory'].get(k, 0))}]".rjust(26)
                 for k in ("all-reduce", "all-gather", "reduce-scatter")]
        print(f"{layout:>10} {mib(row['state_bytes'])} {mib(total(row, 'across'))} " + " ".join(cells))
    hsdp, rep = rows["hsdp"], rows["replicated"]
    print(f"hsdp / replicated bytes across processes: {total(hsdp, 'across') / total(rep, 'across'):.3f} measured, "
          f"{total(hsdp, 'theory') / total(rep, 'theory'):.3f} in theory (1/{inner} of the sharded gradients cross)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "grads": grads, "mesh": dict(mesh.shape), "strategy": args.strategy}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
