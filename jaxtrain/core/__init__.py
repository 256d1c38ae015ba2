"""The math of one update, with no mesh in it: the train state, the step (cast, loss, gradients, update,
metrics) and its context, micro-batch accumulation, precision policies, remat, optimizers, JAX version shims.

Imports nothing of ``parallel/``, ``train/``, ``driver/``: a strategy wraps the step, a trainer places it.
"""
