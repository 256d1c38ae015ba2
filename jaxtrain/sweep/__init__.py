"""Hyperparameter sweeps on Optuna (``python -m jaxtrain.sweep``): the command, its study, its workers, each
trial a run in a subprocess, and the sweep's report.
"""
