"""jaxtrain: pure functional train-step builders for multi-device training."""

from jaxtrain.diagnostics import compiled_stats
from jaxtrain.devices import DATA_AXIS, make_mesh, setup_devices
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import STRATEGIES, ring_allreduce
from jaxtrain.precision import Precision
from jaxtrain.state import TrainState
from jaxtrain.step import Evaluator, Trainer, make_eval_step, make_train_step

__all__ = [
    "DATA_AXIS",
    "STRATEGIES",
    "ConfigError",
    "Precision",
    "compiled_stats",
    "Evaluator",
    "TrainState",
    "Trainer",
    "make_eval_step",
    "make_mesh",
    "make_train_step",
    "ring_allreduce",
    "setup_devices",
]
