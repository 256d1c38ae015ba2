"""Layers that need the step's context or a mesh: flax NNX modules as jaxtrain functions, BatchNorm statistics
over the batch's mesh axes, int8 ops.
"""
