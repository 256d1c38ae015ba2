"""jaxtrain: pure functional train-step builders for multi-device training.

The public names below are imported on first use, so that ``import
jaxtrain.signals`` (or ``jaxtrain.errors``) does not import JAX: the
experiments take SIGINT / SIGTERM over before anything heavy is imported.
"""

import importlib

_EXPORTS = {
    "DATA_AXIS": "jaxtrain.devices",
    "STRATEGIES": "jaxtrain.parallel",
    "ConfigError": "jaxtrain.errors",
    "Precision": "jaxtrain.precision",
    "compiled_stats": "jaxtrain.diagnostics",
    "Evaluator": "jaxtrain.trainer",
    "TrainState": "jaxtrain.state",
    "Frozen": "jaxtrain.state",
    "Trainer": "jaxtrain.trainer",
    "make_eval_step": "jaxtrain.trainer",
    "make_mesh": "jaxtrain.devices",
    "make_train_step": "jaxtrain.trainer",
    "ring_allreduce": "jaxtrain.collectives",
    "ring_all_gather": "jaxtrain.collectives",
    "ring_reduce_scatter": "jaxtrain.collectives",
    "FSDP": "jaxtrain.sharding",
    "MODEL_AXIS": "jaxtrain.devices",
    "REPLICA_AXIS": "jaxtrain.devices",
    "step_context": "jaxtrain.step",
    "StepContext": "jaxtrain.step",
    "Plan": "jaxtrain.placement",
    "Accum": "jaxtrain.accumulate",
    "setup_devices": "jaxtrain.devices",
    "RunConfig": "jaxtrain.config",
    "run": "jaxtrain.runner",
    "dropout": "jaxtrain.step",
    "example_keys": "jaxtrain.step",
    "make_pipeline_step": "jaxtrain.pipeline",
    "STAGE_AXIS": "jaxtrain.pipeline",
    "make_optimizer": "jaxtrain.optim",
    "from_nnx": "jaxtrain.flax_nnx",
    "make_schedule": "jaxtrain.optim",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # next time: a plain attribute
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
