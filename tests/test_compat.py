"""Version differences and GPU readiness that can be checked on a CPU host."""

import warnings

import jax
import optax
import pytest
from conftest import random_batch

import jaxtrain as jt
from jaxtrain import compat
from jaxtrain.models import lenet

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type=reduce"


@pytest.mark.parametrize(("text", "parsed"), [("0.12.0.1", (0, 12, 0)), ("0.10.2", (0, 10, 2)),
                                               ("0.11.0rc1", (0, 11, 0)), ("0.12.1+cuda13", (0, 12, 1))])
def test_version_tuple(text, parsed):
    assert compat.version_tuple(text) == parsed


@pytest.mark.parametrize(("jaxlib", "flags"), [
    ((0, 10, 2), (YNN_FLAG,)), ((0, 11, 2), (YNN_FLAG,)), ((0, 12, 0), (YNN_FLAG,)),
    ((0, 10, 1), ()),  # older than tested: XLA's defaults, never a flag that might not exist
    ((0, 13, 0), ()),  # newer than tested: the same
])
def test_cpu_xla_flags_only_for_jaxlibs_known_to_have_them(jaxlib, flags):
    assert compat.cpu_xla_flags(jaxlib) == flags


def test_the_installed_jaxlib_is_in_the_tested_range_and_gets_the_flag():
    assert compat.installed_version("jaxlib")[:2] in {(0, 10), (0, 11), (0, 12)}, jax.__version__
    assert compat.cpu_xla_flags() == (YNN_FLAG,)


def _trainer(strategy, precision="fp32", accum_steps=1):
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, strategy=strategy, precision=precision,
                                 accum_steps=accum_steps)
    return trainer, trainer.init(lenet.init_params(jax.random.key(0)))


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
@pytest.mark.parametrize(("precision", "accum_steps"), [("fp32", 1), ("bf16", 1), ("fp32", 4)])
def test_train_step_lowers_for_cuda_on_a_cpu_host(strategy, precision, accum_steps):
    """From shapes alone (the public shape-only API: nothing computed or placed), as from a GPU plan."""
    trainer = jt.make_train_step(lenet.loss_fn, optax.sgd(0.1), mesh=2, strategy=strategy, precision=precision,
                                 accum_steps=accum_steps)
    state = trainer.abstract_state(jax.eval_shape(lenet.init_params, jax.random.key(0)))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(state))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), random_batch(64))
    cuda = trainer.lower(state, batch, platforms=("cuda",)).as_text()
    cpu = trainer.lower(state, batch).as_text()
    assert "stablehlo.convolution" in cuda
    assert ("xbf16>" in cuda) == (precision == "bf16")  # the compute dtype reaches the GPU program
    assert "tf.aliasing_output" in cuda or "jax.buffer_donor" in cuda  # the state is donated there too
    # Platform-dependent choices follow the platform compiled FOR, not the host:
    # the micro-batch scan keeps its loop for CUDA and is unrolled for the CPU.
    assert ("stablehlo.while" in cuda) == (accum_steps > 1)
    assert "stablehlo.while" not in cpu


@pytest.mark.filterwarnings("error")
def test_pmap_strategy_runs_without_warnings():
    """jax.pmap is in maintenance mode: the pmap strategy must stay warning-free on every tested JAX."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer, state = _trainer("pmap", accum_steps=2)
        state, metrics = trainer(state, random_batch(64))
        assert float(metrics["loss"]) > 0
