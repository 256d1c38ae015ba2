"""Hyperparameter sweeps on Optuna (``python -m jaxtrain.sweep``): the command, its study, its workers, each
trial a run in a subprocess, and the sweep's report.
"""

__all__ = ["main", "sweep"]


def run_command(argv, prog: str) -> int:
    """The sweep's command line as ``prog`` (``jaxtrain sweep``, ``python -m jaxtrain.sweep``): its extra missing
    is one line, exit 2 (``jaxtrain.sweep.command`` needs optuna to import)."""
    import sys

    from jaxtrain.errors import ConfigError

    try:
        from jaxtrain.sweep.command import main
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.EXIT_CODE
    return main(argv, prog=prog)


def __getattr__(name: str):
    """``from jaxtrain.sweep import sweep`` (the Python API) and ``main`` (the command), imported on first use."""
    if name in __all__:
        from jaxtrain.sweep import command

        return getattr(command, name)
    raise AttributeError(f"module 'jaxtrain.sweep' has no attribute {name!r}")
