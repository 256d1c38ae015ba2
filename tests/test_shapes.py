"""Shape-only compilation (``trainer.abstract_state``, ``lower`` from shapes), the batch search that a GPU plan
uses, and ``jaxtrain.gpu``'s checks that need no CUDA plugin. The GPU compiles themselves: test_gpu_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtrain as jt
from jaxtrain import models
from jaxtrain.analysis import diagnostics
from jaxtrain.analysis.batch_size import find_batch_size
from jaxtrain.errors import ConfigError

LENET = models.get("lenet")


def _trainer(strategy="jit", **kw):
    return jt.make_train_step(LENET.loss_fn, optax.adam(1e-3), mesh=2, strategy=strategy, **kw)


@pytest.mark.parametrize(("strategy", "param_sharding"), [("jit", "replicated"), ("jit", "fsdp"),
                                                          ("shard_map", "fsdp"), ("ring", "replicated"),
                                                          ("pmap", "replicated")])
def test_a_step_compiles_from_shapes_alone_as_from_arrays(strategy, param_sharding):
    trainer = _trainer(strategy, param_sharding=param_sharding, min_size=16)
    abstract = trainer.abstract_state(init_fn=LENET.init, rng=jax.random.key(3))
    state = trainer.init(init_fn=LENET.init, rng=jax.random.key(3))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    shardings = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, abstract))
    assert shardings == jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state))  # placed as init places
    from_shapes = trainer.lower(abstract, LENET.batch_shapes(64)).compile()
    from_arrays = trainer.lower(state, LENET.example_batch(64)).compile()
    assert from_shapes.memory_analysis().temp_size_in_bytes == from_arrays.memory_analysis().temp_size_in_bytes
    assert from_shapes.as_text().count("all-reduce") == from_arrays.as_text().count("all-reduce")
    evaluator = jt.make_eval_step(LENET.eval_fn, mesh=trainer.mesh, strategy=strategy)
    assert evaluator.lower(abstract, LENET.batch_shapes(64)).compile().memory_analysis() is not None


def test_shapes_are_checked_like_batches():
    trainer = _trainer()
    abstract = trainer.abstract_state(LENET.init(jax.random.key(0))[0])  # params given as arrays work too
    from_param_shapes = trainer.abstract_state(jax.eval_shape(lambda r: LENET.init(r)[0], jax.random.key(0)))
    assert from_param_shapes == abstract  # and as shapes (they were closed over as constants, and failed)
    with pytest.raises(ConfigError, match="batch size 63 does not split evenly over 2 devices"):
        trainer.lower(abstract, LENET.batch_shapes(63))
    uneven = {"image": jax.ShapeDtypeStruct((64, 28, 28, 1), jnp.float32),
              "label": jax.ShapeDtypeStruct((32,), jnp.int32)}
    with pytest.raises(ConfigError, match="same leading"):
        trainer.lower(abstract, uneven)


def test_a_pipeline_and_its_eval_step_compile_from_shapes():
    vit = models.get("vit")
    mesh = jt.make_mesh(4, axes={"data": 2, "stage": 2})
    stack = vit.stack
    trainer = jt.make_pipeline_step(stack.embed_fn, stack.stage_fn, stack.head_loss_fn, optax.sgd(0.1), mesh=mesh,
                                    microbatches=2)
    abstract = trainer.abstract_state(init_fn=vit.init)
    assert abstract.params["stages"]  # stored as the schedule places them: [repeats, stages, K, ...]
    param_shapes = jax.eval_shape(lambda r: vit.init(r)[0], jax.random.key(0))
    assert trainer.abstract_state(param_shapes).params == abstract.params  # params as shapes, pipelined alike
    compiled = trainer.lower(abstract, vit.batch_shapes(16)).compile()
    assert "collective-permute" in compiled.as_text()
    evaluator = jt.make_eval_step(trainer.eval_fn(stack.head_eval_fn), mesh=mesh)
    assert evaluator.lower(abstract, vit.batch_shapes(16)).compile() is not None


class _Line:
    """A step whose bytes per device are a + b x batch, that never compiles: the search's own arithmetic."""

    def __init__(self, a, b, unit=8):
        self.a, self.b, self.calls = a, b, []
        self.batch_plan = type("B", (), {"unit": unit})()

    def __call__(self, batch):
        self.calls.append(batch)
        return self.a + self.b * batch


STATE = {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}


@pytest.mark.parametrize("start", [None, 256])
def test_the_batch_search_is_exact_without_a_tolerance(start):
    line = _Line(1_000_000, 4_000)
    found = find_batch_size(line, STATE, None, budget_bytes=500_000_000, max_batch=2**20, start=start,
                            measure=line)
    answer = (500_000_000 - 1_000_000) // 4_000 // 8 * 8
    assert found.batch_size == answer and found.next_batch_size == answer + 8
    assert line(answer) <= 500_000_000 < line(answer + 8)


def test_the_batch_search_aims_from_a_start_and_stops_within_its_tolerance():
    line = _Line(1_000_000, 4_000)
    found = find_batch_size(line, STATE, None, budget_bytes=500_000_000, max_batch=2**20, start=256,
                            measure=line, tolerance=0.02)
    answer = (500_000_000 - 1_000_000) // 4_000 // 8 * 8
    assert 0.98 * answer <= found.batch_size <= answer
    assert len(set(line.calls)) <= 4  # start, 16 x start, the guess, one above it (a line is guessed at once)


def test_the_batch_search_says_when_nothing_fits():
    line = _Line(10**9, 10)
    with pytest.raises(ConfigError, match="smaller than the model"):
        find_batch_size(line, STATE, None, budget_bytes=10**8, start=256, measure=line)


def test_collective_bytes_of_async_ops_count_results_once():
    text = "\n".join([
        "  %a = ((bf16[100]{0}), bf16[100]{0}) all-reduce-start(%x), replica_groups=mesh['data'=8] {'data'}",
        "  %g = ((f32[2,10]{1,0}, f32[4]{0}), (f32[16,10]{1,0}, f32[32]{0})) all-gather-start(%p, %q), "
        "replica_groups=mesh['data'=8] {'data'}",
        "  %r = ((f32[800]{0}), (f32[100]{0})) reduce-scatter-start(%d), replica_groups=mesh['data'=8] {'data'}",
        "  %s = f32[10]{0} reduce-scatter(f32[80]{0} %d), replica_groups={{0,1,2,3,4,5,6,7}}",
    ])
    stats = diagnostics.collective_bytes(text)
    assert stats["all-reduce"] == {"ops": 1, "bytes": 200}
    assert stats["all-gather"] == {"ops": 1, "bytes": (160 + 32) * 4}
    assert stats["reduce-scatter"] == {"ops": 2, "bytes": 800 * 4 + 80 * 4}  # the input, both ways


def test_gpu_targets_hold_the_published_figures_and_bad_names_are_one_line():
    from jaxtrain import gpu

    assert gpu.names() == ("a100", "b200", "h100", "h200", "v100")
    h100 = gpu.target("H100")
    assert (h100.sms, h100.compute_capability, h100.memory_gb, h100.peak_tflops["bf16"]) == (132, (9, 0), 80, 989.5)
    assert gpu.target("h200").memory_bandwidth_gbps == 4800 and gpu.target("a100").peak_flops("fp32") == 156e12
    assert "core_count: 148" in gpu.target("b200").config_text()
    with pytest.raises(ConfigError, match="unknown GPU 'mi300': choose one of a100, b200, h100, h200, v100"):
        gpu.target("mi300")
    assert gpu.target("v100").peak_flops("fp32") == 15.7e12  # no TF32 tensor cores: its fp32 peak
    with pytest.raises(ConfigError, match=r"gpus=16: .* holds at most 8: use hosts= for more \(e.g. gpus=8, hosts=2\)"):
        gpu.mesh_for("h100", gpus=16)
    with pytest.raises(ConfigError, match="product is gpus x hosts = 8"):
        gpu.mesh_for("h100", gpus=8, axes={"data": 4})


def test_without_the_cuda_plugin_the_error_names_the_install(monkeypatch):
    from jaxtrain.gpu import targets

    monkeypatch.setattr(targets, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs JAX's CUDA plugin, which is not installed: pip install "
                                          r"'jaxtrain\[gpu-compile\]' \(in the checkout: pip install -e "
                                          r"'\.\[gpu-compile\]'"):
        targets.mesh_for("h100", gpus=8)


def test_bad_plan_settings_are_one_line_errors():
    from jaxtrain import gpu

    with pytest.raises(ConfigError, match="plan\\(\\) takes the settings .*; not epochs"):
        gpu.plan(epochs=3)
    with pytest.raises(ConfigError, match="memory_fraction=1.5"):
        gpu.plan(memory_fraction=1.5)
    assert np.isfinite(gpu.JAX_MEMORY_FRACTION)
