"""What a compiled step costs, read without running it: FLOPs, bytes, residuals."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from jaxtrain import precision as prec


def _first(analysis):
    """cost_analysis() is a dict in current JAX, a list of dicts in older ones."""
    if isinstance(analysis, (list, tuple)):
        return analysis[0] if analysis else {}
    return analysis or {}


def saved_residual_bytes(trainer, state, batch: Mapping) -> int:
    """Bytes of activations one device saves for the backward pass.

    The residuals ``jax.ad_checkpoint.print_saved_residuals`` lists for the
    loss of one device's (micro-)batch, minus the function's own arguments
    (params and inputs exist anyway). This is what a remat policy controls,
    whatever the backend's scheduler then does with the memory.
    """
    from jax._src.ad_checkpoint import saved_residuals  # the list print_saved_residuals prints

    per_call = trainer.num_devices * (trainer.accum_steps if trainer.accum == "scan" else 1)
    local = {k: jax.ShapeDtypeStruct((np.shape(v)[0] // per_call, *np.shape(v)[1:]), np.asarray(v).dtype
                                     if not isinstance(v, jax.Array) else v.dtype) for k, v in batch.items()}
    policy = trainer.policy

    def loss(params, micro):
        micro = jax.lax.stop_gradient(prec.cast_floats(micro, policy.compute_dtype))
        value, _ = trainer.loss_fn(prec.cast_floats(params, policy.compute_dtype), state.model_state, micro,
                                   jax.random.key(0))
        return value

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
    total = 0
    for aval, source in saved_residuals(loss, params, local):
        if not source.startswith("from the argument"):
            total += int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    return total


def compiled_stats(trainer, state, batch: Mapping) -> dict:
    """FLOPs, bytes and memory of the compiled train step, without running it.

    ``flops`` and ``bytes_accessed`` come from XLA's ``cost_analysis`` (per
    device program); ``temp_bytes``, ``argument_bytes``, ``output_bytes`` and
    ``alias_bytes`` (outputs written into donated inputs) from
    ``memory_analysis``; ``saved_residual_bytes`` from ``saved_residual_bytes``.
    """
    compiled = trainer.lower(state, batch).compile()
    cost = _first(compiled.cost_analysis())
    mem = compiled.memory_analysis()
    return {
        "flops": float(cost.get("flops", float("nan"))),
        "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", -1)),
        "argument_bytes": int(getattr(mem, "argument_size_in_bytes", -1)),
        "output_bytes": int(getattr(mem, "output_size_in_bytes", -1)),
        "alias_bytes": int(getattr(mem, "alias_size_in_bytes", -1)),
        "saved_residual_bytes": saved_residual_bytes(trainer, state, batch),
    }
