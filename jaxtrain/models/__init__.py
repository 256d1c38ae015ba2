"""The models jaxtrain trains: ``get(name)`` (``jaxtrain.models.registry``) -> a ``Model``
(``jaxtrain.models.model``), and the networks themselves (``lenet``, ``resnet``, ``resnet50``, ``vit``).

Importing this package does not import JAX (the command line parses flags first); ``get`` does.
"""

from jaxtrain.models.model import IMAGE_SHAPE, Distillable, LanguageModel, Model, Pipelinable, Stack, Stacked, Student
from jaxtrain.models.registry import (LANGUAGE_MODELS, MODELS, VIT_CONFIGS, Defaults, check_revision, get, names,
                                      revision_settings)

__all__ = ["IMAGE_SHAPE", "LANGUAGE_MODELS", "LanguageModel", "MODELS", "VIT_CONFIGS", "Defaults", "Distillable",
           "Model", "Pipelinable", "Stack", "Stacked", "Student", "check_revision", "get", "names", "revision_settings"]
