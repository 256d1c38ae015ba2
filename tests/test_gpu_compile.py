"""jaxtrain's steps compiled by XLA:GPU for an 8x H100 node on this host (no GPU): the structure the GPUs would
run. Needs the gpu-compile extra (tools/test-gpu-compile makes that venv); skipped without it."""

import re
from importlib.util import find_spec

import optax
import pytest

import jaxtrain as jt
from jaxtrain import assemble, models
from jaxtrain.config import RunConfig
from jaxtrain.data import sources
from jaxtrain.sharding import device_bytes

pytestmark = [pytest.mark.gpu_compile,
              pytest.mark.skipif(not find_spec("jax_cuda12_plugin"),
                                 reason="JAX's CUDA plugin is not installed: pip install -e '.[gpu-compile]' "
                                        "(tools/test-gpu-compile)")]


@pytest.fixture(scope="module")
def gpu():
    import jaxtrain.gpu

    return jaxtrain.gpu


def _compiled(gpu, mesh_axes=None, batch=256, **settings):
    """(trainer, abstract state, compiled step, HLO text) of a run's step for 8 H100s."""
    from jaxtrain.gpu import analysis

    c = RunConfig(devices=8, mesh=mesh_axes, **settings)
    mesh = gpu.mesh_for("h100", 8, axes=c.mesh)
    model = assemble.model(c, sources.shape_of(c.dataset))
    trainer = assemble.steps(c, mesh, model, updates=0)[0]
    state = trainer.abstract_state(init_fn=model.init)
    compiled = trainer.lower(state, model.batch_shapes(batch)).compile(compiler_options=analysis.AUTOTUNER_OFF)
    return trainer, state, compiled, compiled.as_text()


def _gradient_all_reduces(gpu, text, state):
    """All-reduces as big as the gradients (the rest carry the loss, metrics and BatchNorm statistics)."""
    grads = device_bytes(state.params)
    return [c for c in gpu.analysis.collectives(text) if c["kind"] == "all-reduce" and c["bytes"] >= grads // 2]


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_data_parallel_steps_reduce_every_gradient_once_and_keep_the_donation(gpu, strategy):
    _, state, compiled, text = _compiled(gpu, model="lenet", strategy=strategy)
    reduces = _gradient_all_reduces(gpu, text, state)
    assert sum(c["count"] for c in reduces) == 1 and reduces[0]["async"], gpu.analysis.collectives(text)
    aliased = compiled.memory_analysis().alias_size_in_bytes
    assert aliased >= device_bytes((state.params, state.opt_state)) > 0  # donation kept: the state updated in place


def test_scan_accumulation_reduces_once_outside_its_loop(gpu):
    _, state, _, text = _compiled(gpu, model="lenet", accum_steps=4)
    assert "while(" in text  # the micro-batch loop is kept on GPU
    assert all(not c["in_loop"] for c in gpu.analysis.collectives(text)), gpu.analysis.collectives(text)
    assert sum(c["count"] for c in _gradient_all_reduces(gpu, text, state)) == 1


def test_fsdp_shards_the_state_eight_ways_with_gathers_and_reduce_scatters(gpu):
    _, replicated, _, _ = _compiled(gpu, model="resnet18", optimizer="adam", batch=64)
    _, sharded, _, text = _compiled(gpu, model="resnet18", optimizer="adam", param_sharding="fsdp", batch=64)
    full, per_gpu = device_bytes(replicated.params), device_bytes(sharded.params)
    assert full / 8 <= per_gpu < full / 8 * 1.05  # leaves under sharding.MIN_SIZE elements (biases) stay whole
    assert device_bytes(sharded.opt_state) < device_bytes(replicated.opt_state) / 8 * 1.05
    kinds = {c["kind"] for c in gpu.analysis.collectives(text)}
    assert {"all-gather", "reduce-scatter"} <= kinds  # XLA:GPU reduce-scatters (XLA:CPU: all-reduce + slice)


def test_tensor_parallelism_all_reduces_over_the_model_axis(gpu):
    _, _, _, text = _compiled(gpu, mesh_axes={"data": 4, "model": 2}, model="lenet", param_sharding="tp", batch=64)
    # groups of the 2 "model" devices: 4 groups of 2 neighbours (the mesh is (data, model)), or the mesh form
    assert re.search(r"all-reduce(-start)?\(.*replica_groups=(\[4,2\]<=\[8\]|mesh\[[^\]]*\] \{'model'\})", text)


def test_the_pipeline_passes_activations_between_stages(gpu):
    _, _, _, text = _compiled(gpu, mesh_axes={"data": 2, "stage": 4}, model="vit", microbatches=4, batch=64)
    assert any(c["kind"] == "collective-permute" and c["in_loop"] for c in gpu.analysis.collectives(text))


def test_bf16_convolutions_go_to_cudnn_in_bf16(gpu):
    _, _, _, text = _compiled(gpu, model="lenet", precision="bf16")
    kernels = gpu.analysis.kernels(text)
    assert set(kernels["cudnn"]) == {"convBiasActivationForward", "convBackwardInput", "convBackwardFilter"}
    assert re.search(r'= \(bf16\[[\d,]+\]\{[\d,]+\}, u8\[\d+\]\{0\}\) custom-call\(.*"__cudnn\$conv', text)


def test_remat_lowers_the_compiled_temp_memory(gpu):
    """On the ViT's stack of identical blocks (docs/gpu.md: 386.18 MiB none, 180.51 dots, 58.79 full at 1024).
    LeNet and ResNet-18 peak in their first layer's backward, its activation and gradient both live whatever
    is rematerialised, so there remat leaves XLA:GPU's temps as they are (docs/gpu.md)."""
    temps = {remat: _compiled(gpu, model="vit", remat=remat, batch=1024)[2].memory_analysis().temp_size_in_bytes
             for remat in ("none", "dots", "full")}
    assert temps["full"] < 0.25 * temps["none"] and temps["dots"] < 0.6 * temps["none"], temps


@pytest.mark.parametrize(("name", "kernels_per_step"), [("lenet", 2)])
def test_the_pallas_kernels_compile_to_gpu_code(gpu, name, kernels_per_step):
    _, _, _, text = _compiled(gpu, model=name, kernels="pallas")
    assert gpu.analysis.kernels(text)["pallas_kernels"] == kernels_per_step  # forward and backward, Triton
    assert "while(" not in text  # not the CPU's interpret-mode loop


def test_the_ring_strategy_compiles_in_fp32(gpu):
    """In fp32: its bf16 compile spends ~5 min in XLA:GPU's autotuning pass on 2 cores (REFERENCE.md §5)."""
    _, _, _, text = _compiled(gpu, model="lenet", strategy="ring", batch=64)
    assert any(c["kind"] == "collective-permute" for c in gpu.analysis.collectives(text))


def test_pmap_compiles_from_shapes_too(gpu):
    trainer = jt.make_train_step(models.get("lenet").loss_fn, optax.sgd(0.1), mesh=gpu.mesh_for("h100", 8),
                                 strategy="pmap")
    state = trainer.abstract_state(init_fn=models.get("lenet").init)
    assert "all-reduce" in trainer.lower(state, models.get("lenet").batch_shapes(64)).compile().as_text()


def test_the_autotuner_off_gives_the_same_memory(gpu):
    """What the largest-batch search relies on (jaxtrain.gpu.analysis.AUTOTUNER_OFF)."""
    trainer, state, off, _ = _compiled(gpu, model="resnet18", precision="bf16", batch=128)
    on = trainer.lower(state, models.get("resnet18").batch_shapes(128)).compile()
    assert gpu.analysis.memory(on) == gpu.analysis.memory(off)


def test_a_plan_reports_memory_flops_collectives_and_the_largest_batch(gpu):
    p = gpu.plan(model="lenet", precision="bf16", gpu="h100", gpus=8)
    assert p.fits and p.donation_kept and p.per_gpu_batch == 32
    assert 3.3e9 / 8 < p.flops < 3.6e9 / 8  # 3.43 GFLOP for the whole step, convolutions included (REFERENCE §5)
    assert p.largest_batch is not None and p.largest_batch_bytes <= p.budget_bytes < p.search[-1][1] or \
        p.largest_batch >= p.max_batch
    assert "FITS" in p.format() and "all-reduce" in p.format()
    assert p.to_json()["memory"]["params"] == p.memory["params"]


def test_the_cli_prints_the_plan_and_writes_json(tmp_path):
    from conftest import run_cli

    r = run_cli("-m", "experiments.gpu_plan", "--model", "lenet", "--precision", "bf16", "--no-search",
                "--json", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    assert "FITS" in r.stdout and "cuDNN: convBackwardFilter x2" in r.stdout
    assert (tmp_path / "plan.json").exists()


def test_the_readme_table_command_prints_a_row_per_plan(capsys):
    from experiments import bench_gpu_plans

    assert bench_gpu_plans.main(["--models", "lenet", "--gpus", "8"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].startswith("| model | H100s |") and len(rows) == 3
    assert rows[2].startswith("| lenet | 8 | 256 |") and "all-reduce (" in rows[2]
