"""The d2l LeNet: layer shapes, parameter count, init, output shape."""

import jax
import numpy as np

from jaxtrain.models import lenet


def test_lenet_shapes_and_parameter_count():
    params = lenet.init_params(jax.random.key(0))
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == {
        "conv1": {"w": (3, 3, 1, 20), "b": (20,)},
        "conv2": {"w": (5, 5, 20, 50), "b": (50,)},
        "dense1": {"w": (800, 128), "b": (128,)},
        "dense2": {"w": (128, 10), "b": (10,)},
    }
    assert sum(x.size for x in jax.tree.leaves(params)) == 20 * 9 + 20 + 50 * 20 * 25 + 50 + 800 * 128 + 128 + 1290
    assert sum(x.size for x in jax.tree.leaves(params)) == 129_068
    w = np.asarray(params["dense1"]["w"])
    assert abs(w.std() - 0.01) < 0.001 and np.all(np.asarray(params["dense1"]["b"]) == 0)  # d2l: N(0,1)*0.01, 0


def test_lenet_output_shape():
    params = lenet.init_params(jax.random.key(0))
    logits = lenet.apply(params, np.zeros((5, 28, 28, 1), np.float32))
    assert logits.shape == (5, 10) and logits.dtype == np.float32
