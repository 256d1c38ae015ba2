"""experiments.bench's variants, each a step to time: (a) jaxtrain's step with a user's defaults, (b) the
hand-written ``jax.jit`` SGD step of the same model (the overhead reference), and jaxtrain's int8 and fp32
inference (``--precision int8``)."""

from __future__ import annotations


def train_timers(args, jt, mesh, model):
    """(a) and (b): ``{name: [step, state]}`` of jaxtrain's step and the hand-written one, and the compile-time
    cost of jaxtrain's step (FLOPs, bytes, over all devices)."""
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
    # fresh buffers for each: the steps donate them
    runs = {"jaxtrain": [trainer, trainer.init(params0, model_state0)],
            "handwritten": [hand, place((params0, model_state0), replicated)]}
    n = len(mesh.devices.flat)
    return runs, trainer.shard(host), cost["flops"] * n, cost["bytes_accessed"] * n


def int8_timers(args, model):
    """``{name: fn}`` of jaxtrain's int8 and fp32 inference (``jaxtrain.analysis.quantize``) on one batch, and the fp32
    forward's FLOPs."""
    import jax

    from jaxtrain.analysis import quantize

    params0, model_state0 = jax.jit(model.init)(jax.random.key(0))
    meta = {"model": args.model, "input_shape": list(model.input_shape), "num_classes": model.num_classes}
    q = quantize.quantize(meta, params0, model_state0)
    x = jax.device_put(model.example_batch(args.batch_size)["image"])
    cost = q.apply_fp32.lower(q.fp32_variables, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"jaxtrain": lambda: q.int8(x), "jaxtrain_fp32": lambda: q.fp32(x)}, cost.get("flops", 0.0)
