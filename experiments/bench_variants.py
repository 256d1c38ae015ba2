"""experiments.bench's variants, each a ``harness.Timed``: (a) jaxtrain's step with a user's defaults, (b) the
hand-written ``jax.jit`` SGD step of the same model (the overhead reference), jaxtrain's int8 and fp32 inference
(``--precision int8``), (c) PyTorch's, in its own process; the model itself (a GPT of ``--model-size``,
``--seq-len`` and ``--vocab``) and what its lines and JSON say of it."""

from __future__ import annotations

from experiments import harness
from experiments.harness import UNROLL

TITLES = {"lenet": "LeNet", "resnet18": "ResNet-18", "resnet18_imagenet": "ResNet-18 (ImageNet's)",
          "resnet50": "ResNet-50", "vit": "ViT", "gpt": "GPT"}


def get_model(args, conv: str):
    """The registry's ``args.model``; a language model's of ``args.model_size`` for windows of ``args.seq_len``
    tokens over ``args.vocab`` (each filled in with the size's own where not given)."""
    from jaxtrain import models

    if args.model not in models.LANGUAGE_MODELS:
        return models.get(args.model, conv=conv)
    from jaxtrain.models import gpt

    args.model_size = args.model_size or models.registry.DEFAULT_SIZE
    config = gpt.SIZES[args.model_size]
    args.seq_len, args.vocab = args.seq_len or config.seq_len, args.vocab or config.vocab
    return models.get(args.model, input_shape=(args.seq_len,), num_classes=args.vocab, size=args.model_size,
                      unroll=UNROLL.get(args.unroll), rotary=bool(args.rotary), conv=conv)


def torch_shape(model) -> tuple[int, ...]:
    """What bench_torch's GPT is built of (vocab, seq_len, layers, heads, width, and 1 where its positions are
    rotary); () for the image models."""
    c = getattr(model, "config", None)
    return () if c is None else (c.vocab, c.seq_len, c.layers, c.heads, c.width, *((1,) if c.rotary else ()))


def title(args, model) -> str:
    """The model as the bench's heading says it."""
    c = getattr(model, "config", None)
    if c is None:
        return TITLES.get(args.model, args.model)
    return (f"{TITLES.get(args.model, args.model)} {args.model_size} ({c.layers} layers of width {c.width}, "
            f"{c.heads} heads, {'unrolled' if c.unroll else 'a loop over one'}"
            f"{', rotary positions' if c.rotary else ''}; windows of {c.seq_len} tokens, "
            f"vocabulary {c.vocab} padded to {c.padded_vocab})")


def lm_fields(args, model, med: dict) -> dict:
    """A language model's shape and each variant's tokens/s, for the JSON."""
    c = model.config
    return {"model_size": args.model_size, "seq_len": c.seq_len, "vocab": c.vocab, "padded_vocab": c.padded_vocab,
            "layers": c.layers, "heads": c.heads, "width": c.width, "unroll": c.unroll, "rotary": c.rotary,
            **{f"{k}_tokens_per_s": args.batch_size * c.seq_len / (ms * 1e-3) for k, ms in med.items()}}


def train_timers(args, jt, mesh, model):
    """(a) and (b): ``{name: Timed}`` of jaxtrain's step and the hand-written one, and the compile-time cost of
    jaxtrain's step (FLOPs, bytes, over all devices)."""
    loss_fn = model.loss_fn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain.core.precision import cast_floats
    from jaxtrain.parallel.sharding import place

    params0, model_state0 = jax.jit(model.init)(jax.random.key(0))
    host = model.example_batch(args.batch_size)
    trainer = jt.make_train_step(loss_fn, optax.sgd(0.2), mesh=mesh, precision=args.precision)  # (a) the defaults
    trainer.check_batch_size(args.batch_size)
    cost = jt.compiled_stats(trainer, trainer.init(params0, model_state0), host, residuals=False)  # per device
    compute = jnp.bfloat16 if args.precision == "bf16" else jnp.float32

    # (b) hand-written: the step anyone would write, same shardings, donation and precision.
    def sgd_step(carry, b):
        params, model_state = carry

        def loss(p):
            value, aux = loss_fn(cast_floats(p, compute), model_state, cast_floats(b, compute), None)
            return value.astype(jnp.float32), aux

        (value, (model_state, _)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return (jax.tree.map(lambda p, g: p - 0.2 * g, params, grads), model_state), {"loss": value}

    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(jt.DATA_AXIS))
    hand = jax.jit(sgd_step, in_shardings=(replicated, sharded), out_shardings=replicated, donate_argnums=0)
    batch, n = trainer.shard(host), len(mesh.devices.flat)
    # fresh buffers for each: the steps donate them
    runs = {"jaxtrain": harness.Timed(trainer, trainer.init(params0, model_state0), batch),
            "handwritten": harness.Timed(hand, place((params0, model_state0), replicated), batch)}
    return runs, cost["flops"] * n, cost["bytes_accessed"] * n


def int8_timers(args, model):
    """``{name: Timed}`` of jaxtrain's int8 and fp32 inference (``jaxtrain.analysis.quantize``) on one batch, the fp32
    forward's FLOPs, and None (no bytes): each a call of no state (``Dispatched``)."""
    import jax

    from jaxtrain.analysis import quantize

    params0, model_state0 = jax.jit(model.init)(jax.random.key(0))
    meta = {"model": args.model, "input_shape": list(model.input_shape), "num_classes": model.num_classes}
    q = quantize.quantize(meta, params0, model_state0)
    x = jax.device_put(model.example_batch(args.batch_size)["image"])
    cost = q.apply_fp32.lower(q.fp32_variables, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    runs = {name: Dispatched(infer, None, x) for name, infer in (("jaxtrain", q.int8), ("jaxtrain_fp32", q.fp32))}
    return runs, cost.get("flops", 0.0), None


class Dispatched(harness.Timed):
    """A call of no state (``step(batch)``: an inference), ``steps`` of them dispatched and waited for once."""

    def time(self, steps: int) -> float:
        import time

        import jax

        start = time.perf_counter()
        jax.block_until_ready([self.step(self.batch) for _ in range(steps)])
        return (time.perf_counter() - start) / steps


class TorchTimed(harness.Timed):
    """(c) PyTorch's step or inference (``step``: a ``bench_torch.TorchWorker``), which times itself in its process."""

    def time(self, steps: int) -> float:
        return self.step.time(steps)


def torch_timers(args, model) -> dict:
    """(c) ``{name: TorchTimed}``: ``torch`` as installed, and ``torch_same_malloc`` with jaxtrain's malloc settings
    where this process runs with them (``jaxtrain.parallel.host_memory``); int8: ``torch`` (``quantize_dynamic``)
    and ``torch_fp32``."""
    from experiments.bench_torch import TorchWorker
    from jaxtrain.parallel import host_memory

    infer = args.precision == "int8"
    modes = {"torch": "int8" if infer else args.precision, **({"torch_fp32": "fp32-infer"} if infer else {}),
             **({"torch_same_malloc": args.precision} if not infer and host_memory.applied() else {})}
    return {name: TorchTimed(TorchWorker(args.model, args.batch_size, python=args.torch_python, mode=mode,
                                         env=host_memory.ENV_SETTINGS if name == "torch_same_malloc" else None,
                                         shape=torch_shape(model)), None, None)
            for name, mode in modes.items()}
