"""The experiments' shared command line: flags, set-up, training run, outputs.

An experiment (``experiments/lenet.py``, ...) is a ``Model`` plus defaults;
everything else (devices, data, loop, files, errors) lives here once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

from jaxtrain.errors import ConfigError
from jaxtrain.flags import make_parser, positive_int  # noqa: F401  (the experiments' imports)
from jaxtrain.signals import StopOnSignal


@dataclasses.dataclass(frozen=True)
class Model:
    """What an experiment trains: ``init(rng) -> (params, model_state)`` and its fns."""

    name: str
    init: Callable
    loss_fn: Callable
    eval_fn: Callable
    apply: Callable | None = None  # apply(params, images) -> logits, for the model summary
    tp_rules: tuple = ()  # ((regex, PartitionSpec over "model"), ...): --param-sharding tp / fsdp+tp


# Settings that change what a checkpoint's state means: --resume refuses to mix them.
FIXED_SETTINGS = ("experiment", "dataset", "data_sha256", "train_subset", "optimizer", "lr", "batch_size", "seed",
                  "precision", "accum_steps", "accum")
# Settings a resumed run may change (reported when they do).
FREE_SETTINGS = ("devices", "processes", "strategy", "mesh", "param_sharding", "remat", "epochs", "max_steps")


def run(args: argparse.Namespace, model: Model, stop: StopOnSignal | None = None) -> dict:
    """Train ``model`` as ``args`` say; print progress; write the run's files."""
    import jaxtrain as jt

    devices = jt.setup_devices(args.devices, devices_per_process=args.devices_per_process,  # first: nothing
                               coordinator=args.coordinator, num_processes=args.num_processes,  # may start JAX
                               process_id=args.process_id)  # before this
    import jax
    import optax

    main_process = jax.process_index() == 0
    say = print if main_process else (lambda *a, **k: None)  # only process 0 prints and writes files
    stop = stop or StopOnSignal()
    stop.multi_process = jax.process_count() > 1
    stop.reinstall()

    from jaxtrain import remat, sharding
    from jaxtrain.data import loader, sources
    from jaxtrain.loop import Interrupted, fit
    from jaxtrain.report import RunWriter, ensure_room, make_out_dir, params_digest, run_summary

    remat.policy(args.remat)  # a bad name fails here, before any data is read
    mesh = jt.make_mesh(devices, axes=args.mesh)
    param_sharding = sharding.preset(args.param_sharding, model.tp_rules)
    trainer = jt.make_train_step(model.loss_fn, optax.sgd(args.lr), mesh=mesh, strategy=args.strategy,
                                 precision=args.precision, accum_steps=args.accum_steps, accum=args.accum,
                                 param_sharding=param_sharding)
    # A bad sharding (an axis the mesh lacks, a split that does not divide) fails here, before any data is read.
    layout = trainer.plan(jax.eval_shape(model.init, jax.random.key(args.seed))[0])
    call_batch = args.batch_size
    if args.accum == "multisteps":  # one call per micro-batch
        if args.batch_size % args.accum_steps:
            raise ConfigError(f"--batch-size {args.batch_size} does not split into --accum-steps "
                              f"{args.accum_steps} micro-batches: use a multiple of {args.accum_steps}")
        call_batch = args.batch_size // args.accum_steps
    trainer.check_batch_size(call_batch)
    evaluator = jt.make_eval_step(model.eval_fn, mesh=mesh, strategy=args.strategy)
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        raise ConfigError("--resume and --checkpoint-every need --checkpoint-dir DIR")

    from jaxtrain.checkpoint import Checkpointer

    checkpointer = Checkpointer(args.checkpoint_dir, args.keep_checkpoints, fixed=FIXED_SETTINGS) \
        if args.checkpoint_dir else None  # writable and ours (locked) before the data is read
    if checkpointer is not None and not args.resume and checkpointer.latest() is not None:
        raise ConfigError(f"{checkpointer.directory} already holds checkpoints (newest: step {checkpointer.latest()}): "
                          "pass --resume to continue that run, or another --checkpoint-dir to start afresh")
    data = {s: sources.load_split(args.dataset, s, idx_dir=args.data_dir, tfds_dir=args.tfds_dir) for s in ("train", "test")}
    settings = {"experiment": model.name, "dataset": args.dataset, "data_sha256": sources.split_digest(*data.values()),
                "train_subset": args.train_subset, "optimizer": "sgd", "lr": args.lr, "batch_size": args.batch_size,
                "seed": args.seed, "precision": args.precision, "accum_steps": args.accum_steps, "accum": args.accum,
                "devices": len(devices), "processes": jax.process_count(), "strategy": args.strategy,
                "mesh": args.mesh, "param_sharding": args.param_sharding,  # mesh: the flag (None: data=devices)
                "remat": args.remat, "epochs": args.epochs, "max_steps": args.max_steps}
    if checkpointer is not None:
        checkpointer.settings = settings
    data = {"train": data["train"].head(args.train_subset), "test": data["test"].head(args.test_subset)}
    train = loader.Loader(data["train"], call_batch, train=True, seed=args.seed, workers=args.workers)
    test = loader.Loader(data["test"], args.batch_size, train=False, workers=args.workers)
    platform = devices[0].platform

    from jaxtrain import diagnostics

    state = trainer.init(init_fn=model.init, rng=jax.random.key(args.seed))  # each device makes its shards
    position = None
    if args.resume:
        restored = checkpointer.restore(state)
        if restored is None:
            say(f"no checkpoint in {args.checkpoint_dir} yet: starting from scratch")
        else:
            state, position = restored.state, restored.position
            done = position.result and (position.epoch > args.epochs or
                                        args.max_steps is not None and position.total_steps >= args.max_steps)
            if done:
                r = position.result
                say(f"already finished at step {position.total_steps} (checkpoint in {args.checkpoint_dir}): "
                    f"test acc {r['test_acc']:.3f}, test loss {r['test_loss']:.4f}; nothing to do "
                    "(raise --epochs or --max-steps to train on)")
                checkpointer.close()
                return {"already_finished": True, "steps": position.total_steps, "test_acc": r["test_acc"]}
            changed = [f"{k} {restored.settings.get(k)!r} -> {settings[k]!r}" for k in FREE_SETTINGS
                       if restored.settings.get(k) != settings[k]]
            say(f"resuming from step {position.total_steps} (epoch {position.epoch}, batch {position.batch})"
                + (f"; changed since: {', '.join(changed)}" if changed else ""))
    out_dir = make_out_dir(args.out, model.name) if main_process else None
    if main_process:
        ensure_room(out_dir, 2**20, "metrics, summary and curves", "--out")
        if checkpointer is not None:  # keep + 1 on disk at once (the newest is written before the oldest goes)
            more = max(args.keep_checkpoints + 1 - len(checkpointer.manager.all_steps()), 1)
            size = sum(x.nbytes for x in jax.tree.leaves(state)) + 2**16  # + orbax's metadata files
            ensure_room(checkpointer.directory, more * size, f"{more} more checkpoint(s)", "--checkpoint-dir")
    writer = RunWriter(out_dir, position.history if position else ()) if main_process else None
    say(f"{model.name}: {len(data['train'])} train / {len(data['test'])} test examples of {args.dataset}, "
        f"batch {args.batch_size} on {len(devices)} {platform} device(s), strategy {args.strategy}, "
        f"mesh {','.join(f'{k}={v}' for k, v in mesh.shape.items())}, {args.param_sharding} "
        f"({len(layout['sharded'])} of {len(layout['sharded']) + len(layout['replicated'])} parameters sharded), "
        f"{args.precision}, accum {args.accum_steps} ({args.accum}), remat {args.remat}"
        + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "") + f"; out: {out_dir}", flush=True)
    if args.summary:
        images = loader.normalise(data["test"].head(8).images) if model.apply else None
        say(diagnostics.format_summary(diagnostics.summarize(state.params, model.apply, images)))
    if args.memory_report:
        say("memory at start:\n" + diagnostics.format_memory_report(diagnostics.memory_report()))
    stats = jt.compiled_stats(trainer, state, next(iter(train.epoch(0))))
    peak = (diagnostics.measure_matmul_peak() if args.measure_peak
            else diagnostics.gpu_peak_flops(devices[0].device_kind, args.precision) if platform == "gpu" else None)

    def on_step(n):
        if args.memory_report and n == 1:
            say("memory after the first step:\n" + diagnostics.format_memory_report(diagnostics.memory_report()))

    def on_epoch(s):
        if writer is not None:
            writer.epoch(s)
        say(f"epoch {s.epoch}/{args.epochs}: train loss {s.train_loss:.4f}, train acc {s.train_acc:.3f}, "
            f"test acc {s.test_acc:.3f}, {s.train_sec:.1f} sec, data wait {100 * s.data_wait_fraction:.1f}%",
            flush=True)

    def save(state, position):
        with stop.busy():
            checkpointer.save(state, position)

    try:
        stop.training()
        state, history, first_loss = fit(
            trainer, state, train, evaluator, test, epochs=args.epochs, max_steps=args.max_steps,
            on_epoch=on_epoch, progress=False if args.no_progress or not main_process else None,
            prefetch=args.prefetch, on_step=on_step, position=position,
            save=save if checkpointer else None, save_every=args.checkpoint_every, should_stop=stop.requested)
    except Interrupted as e:
        stop.done()
        step = e.position.total_steps
        if checkpointer is None:
            say(f"stopped by signal at step {step}; nothing saved (no --checkpoint-dir)")
        else:
            with stop.busy():
                checkpointer.close()
            if checkpointer.committed(step):
                say(f"stopped by signal at step {step}; checkpoint saved in {checkpointer.directory}: "
                    "continue with --resume")
            else:
                say(f"stopped by signal at step {step}; the checkpoint of step {step} was NOT written; the newest "
                    f"is step {checkpointer.latest()}: continue from there with --resume")
        raise _Exit(128 + stop.signum) from None
    stop.done()
    if checkpointer is not None:
        with stop.busy():
            checkpointer.close()
    summary = run_summary(args, model.name, history, first_loss, stats, peak, devices, call_batch, len(train),
                          {k: len(v) for k, v in data.items()}, settings["data_sha256"])
    summary["params_digest"] = params_digest(state.params)
    summary.update(mesh=dict(mesh.shape), param_sharding=args.param_sharding, sharded_params=layout["sharded"],
                   collectives=stats["collectives"])
    last, plural = history[-1], "s" * (len(devices) != 1)
    # The result first: if writing the files fails (full disk), the user still has it.
    say(f"test acc {last.test_acc:.2f}, {summary['sec_per_epoch']:.1f} sec/epoch on {len(devices)} device{plural} "
        f"({platform})", flush=True)
    if writer is not None:
        writer.summary(summary)
    say(f"wrote {out_dir}/summary.json, metrics.jsonl, curves.png")
    if jax.process_count() > 1:  # every process vouches for the same result
        print(f"process {jax.process_index()}: params_digest {summary['params_digest']}", flush=True)
    return summary


class _Exit(Exception):
    def __init__(self, code: int):
        self.code = code


def main(parser: argparse.ArgumentParser | Callable[[], argparse.ArgumentParser],
         model_factory: Callable[[argparse.Namespace], Model], argv: Sequence[str] | None = None) -> int:
    """Parse, run, and turn user errors into one line on stderr with exit code 2.

    SIGTERM / SIGINT are handled from here on (jaxtrain.signals): at start-up
    they exit at once, during training they checkpoint and stop. Pass the
    parser as a function (and import models inside ``model_factory``) so that
    importing JAX happens here too.
    """
    with StopOnSignal() as stop:
        parser = parser() if callable(parser) else parser
        args = parser.parse_args(argv)
        return _main(parser, args, model_factory, stop)


def _main(parser, args, model_factory, stop) -> int:
    try:
        run(args, model_factory(args), stop)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except _Exit as e:
        return e.code
    except Exception as e:
        if not _peer_gone(e):
            raise
        print(f"{parser.prog}: error: a collective failed ({str(e).splitlines()[0][:200]}): another process of "
              "this run is gone (the launcher's message says which); --resume continues from the last checkpoint",
              file=sys.stderr)
        return 1
    return 0


def _peer_gone(e: Exception) -> bool:
    """A runtime error of a multi-process run's collective: a peer died (gloo: "Connection closed by peer")."""
    jax = sys.modules.get("jax")
    return (jax is not None and type(e).__name__ == "JaxRuntimeError" and jax.distributed.is_initialized()
            and jax.process_count() > 1)
