"""Hyperparameter sweeps on Optuna (``python -m jaxtrain.sweep``): the command, its study, its workers, each
trial a run in a subprocess, and the sweep's report.
"""

__all__ = ["sweep"]


def __getattr__(name: str):
    """``from jaxtrain.sweep import sweep`` (the Python API), imported on first use (it needs optuna)."""
    if name in __all__:
        from jaxtrain.sweep import command

        return getattr(command, name)
    raise AttributeError(f"module 'jaxtrain.sweep' has no attribute {name!r}")
