"""jaxtrain: pure functional train-step builders for multi-device training.

The public names below are imported on first use, so that ``import
jaxtrain.driver.signals`` (or ``jaxtrain.errors``) does not import JAX: the
experiments take SIGINT / SIGTERM over before anything heavy is imported.
"""

import importlib

from jaxtrain.version import __version__  # noqa: F401  (CHANGELOG.md)

_EXPORTS = {
    "DATA_AXIS": "jaxtrain.parallel.devices",
    "STRATEGIES": "jaxtrain.parallel.strategies",
    "ConfigError": "jaxtrain.errors",
    "Precision": "jaxtrain.core.precision",
    "compiled_stats": "jaxtrain.analysis.diagnostics",
    "Evaluator": "jaxtrain.train.trainer",
    "TrainState": "jaxtrain.core.state",
    "Frozen": "jaxtrain.core.state",
    "Trainer": "jaxtrain.train.trainer",
    "make_eval_step": "jaxtrain.train.trainer",
    "make_mesh": "jaxtrain.parallel.devices",
    "make_train_step": "jaxtrain.train.trainer",
    "ring_allreduce": "jaxtrain.parallel.collectives",
    "ring_all_gather": "jaxtrain.parallel.collectives",
    "ring_reduce_scatter": "jaxtrain.parallel.collectives",
    "FSDP": "jaxtrain.parallel.rules",
    "MODEL_AXIS": "jaxtrain.parallel.devices",
    "REPLICA_AXIS": "jaxtrain.parallel.devices",
    "step_context": "jaxtrain.core.context",
    "StepContext": "jaxtrain.core.context",
    "Plan": "jaxtrain.parallel.placement",
    "Accum": "jaxtrain.core.accumulate",
    "setup_devices": "jaxtrain.parallel.devices",
    "RunConfig": "jaxtrain.driver.config",
    "run": "jaxtrain.driver.runner",
    "dropout": "jaxtrain.core.context",
    "example_keys": "jaxtrain.core.context",
    "make_pipeline_step": "jaxtrain.train.pipeline",
    "STAGE_AXIS": "jaxtrain.train.pipeline",
    "make_optimizer": "jaxtrain.core.optim",
    "from_nnx": "jaxtrain.nn.flax_nnx",
    "make_schedule": "jaxtrain.core.optim",
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
