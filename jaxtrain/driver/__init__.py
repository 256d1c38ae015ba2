"""One training run from a ``RunConfig``: validate, assemble the model and steps, train, observe, track, write
the run's files, export the model; the run's signals.

Only the command lines (``jaxtrain.cli``, ``jaxtrain.sweep``) and ``gpu/`` stand above it. Named
``driver``, not ``run``: ``jt.run`` is the function that runs one (a subpackage of that name would shadow it).
"""
