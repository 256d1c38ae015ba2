"""BatchNorm's statistics, flax's vs jaxtrain's (``jaxtrain.nn.batch_stats``), in numbers (docs/performance.md,
"BatchNorm's collectives"):

1. ResNet-18's gradient (XLA's convolutions, test_resnet's linen weights, batch 16, 1 device) against float64:
   the largest and the median relative error over the kernels and scales, with flax's statistics and with
   jaxtrain's (forced on at 1 device: two passes and the elementwise backward);
2. test_resnet's 3 SGD steps (He init, lr 1e-3, its batches) on 2 devices (jit, FSDP) against 1 device: the
   largest |difference| in params and in statistics, with ReLU and with softplus in its place.
    python tools/cpu-probes/bn_numerics.py
"""

import os
import statistics
import sys

import jaxtrain as jt

jt.setup_devices(4)  # as the tests run
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import linen_resnet  # noqa: E402
from test_resnet import BATCHES, to_nnx  # noqa: E402

from jaxtrain import models  # noqa: E402
from jaxtrain.models import resnet  # noqa: E402


def grads(stats, dtype, params, model_state, batch):
    loss_fn = resnet.adapter(batch_stats=stats).loss_fn

    def cast(tree):
        return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)

    batch = {"image": jnp.asarray(batch["image"], dtype), "label": batch["label"]}
    return jax.jit(jax.grad(lambda p: loss_fn(p, cast(model_state), batch, jax.random.key(0))[0]))(cast(params))


def against_float64():
    params, model_state = to_nnx(*linen_resnet.init_variables(jax.random.key(0), linen_resnet.ResNet18()))
    rng = np.random.default_rng(11)
    batch = {"image": rng.random((16, 28, 28, 1), dtype=np.float32), "label": rng.integers(0, 10, 16).astype(np.int32)}
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else _x64():
        exact = grads("flax", jnp.float64, params, model_state, batch)
    split = resnet.split
    for stats in ("flax", "jaxtrain"):
        resnet.split = (lambda *a: True) if stats == "jaxtrain" else split  # 1 device: jaxtrain's path too
        got = grads(stats, jnp.float32, params, model_state, batch)
        resnet.split = split
        errors = [float(jnp.max(jnp.abs(g - e)) / jnp.max(jnp.abs(e)))
                  for (path, e), g in zip(jax.tree_util.tree_flatten_with_path(exact)[0], jax.tree.leaves(got))
                  if "kernel" in jax.tree_util.keystr(path) or "scale" in jax.tree_util.keystr(path)]
        print(f"vs float64, {stats:8s} statistics: largest {max(errors):.1e}, median {statistics.median(errors):.1e}")


class _x64:
    def __enter__(self):
        jax.config.update("jax_enable_x64", True)

    def __exit__(self, *exc):
        jax.config.update("jax_enable_x64", False)


def three_steps(n, stats):
    model = models.get("resnet18", init="he", conv="xla")
    loss_fn = resnet.adapter(weight_init="he", batch_stats=stats).loss_fn
    trainer = jt.make_train_step(loss_fn, optax.sgd(1e-3), mesh=n, param_sharding="fsdp" if n > 1 else "replicated")
    state = trainer.init(*model.init(jax.random.key(0)))
    for batch in BATCHES:
        state, _ = trainer(state, batch)
    return jax.device_get(state)


def one_vs_two_devices():
    relu = nnx.relu
    for activation, fn in (("relu", relu), ("softplus", jax.nn.softplus)):
        nnx.relu = fn  # read as the model is traced
        for stats in ("flax", "jaxtrain"):
            one, two = three_steps(1, stats), three_steps(2, stats)

            def diff(a, b):  # the largest difference of any element
                return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

            print(f"1 vs 2 devices, {activation:8s} {stats:8s} statistics: params {diff(one.params, two.params):.1e}, "
                  f"statistics {diff(one.model_state, two.model_state):.1e}")
    nnx.relu = relu


against_float64()
one_vs_two_devices()
