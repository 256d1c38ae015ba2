"""jaxtrain's steps compiled by XLA:GPU for an 8x H100 node on this host (no GPU): the structure the GPUs would
run. Needs the gpu-compile extra (tools/test-gpu-compile makes that venv); skipped without it."""

import re
from pathlib import Path
from importlib.util import find_spec

import optax
import pytest

import jaxtrain as jt
from jaxtrain import models
from jaxtrain.data import sources
from jaxtrain.parallel.sharding import device_bytes
from jaxtrain.driver import assemble
from jaxtrain.driver.config import RunConfig

pytestmark = [pytest.mark.gpu_compile,
              pytest.mark.skipif(not find_spec("jax_cuda12_plugin"),
                                 reason="JAX's CUDA plugin is not installed: pip install -e '.[gpu-compile]' "
                                        "(tools/test-gpu-compile)")]


@pytest.fixture(scope="module")
def gpu():
    import jaxtrain.gpu

    return jaxtrain.gpu


def _compiled(gpu, mesh_axes=None, batch=256, shape=None, **settings):
    """(trainer, abstract state, compiled step, HLO text) of a run's step for 8 H100s (``shape``: its data's, for
    text)."""
    from jaxtrain.gpu import analysis

    c = RunConfig(devices=8, mesh=mesh_axes, **settings)
    mesh = gpu.mesh_for("h100", 8, axes=c.mesh)
    model = assemble.model(c.network, c.compute, shape or sources.shape_of(c.dataset), devices=tuple(mesh.devices.flat))
    trainer = assemble.steps(c.network, c.optim, c.parallel, mesh, model, updates=0)[0]
    state = trainer.abstract_state(init_fn=model.init)
    compiled = trainer.lower(state, model.batch_shapes(batch)).compile(compiler_options=analysis.AUTOTUNER_OFF)
    return trainer, state, compiled, compiled.as_text()


def _gradient_all_reduces(gpu, text, state):
    """All-reduces as big as the gradients (the rest carry the loss, metrics and BatchNorm statistics)."""
    grads = device_bytes(state.params)
    return [c for c in gpu.analysis.collectives(text) if c["kind"] == "all-reduce" and c["bytes"] >= grads // 2]


@pytest.mark.parametrize("strategy", ["jit", "explicit", "shard_map"])
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
    assert full / 8 <= per_gpu < full / 8 * 1.05  # leaves under rules.MIN_SIZE elements (biases) stay whole
    assert device_bytes(sharded.opt_state) < device_bytes(replicated.opt_state) / 8 * 1.05
    kinds = {c["kind"] for c in gpu.analysis.collectives(text)}
    assert {"all-gather", "reduce-scatter"} <= kinds  # XLA:GPU reduce-scatters (XLA:CPU: all-reduce + slice)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_zero1_keeps_the_params_whole_and_shards_the_adam_state_eight_ways(gpu, strategy):
    _, replicated, _, _ = _compiled(gpu, model="resnet18", optimizer="adam", batch=64)
    _, zero1, _, text = _compiled(gpu, model="resnet18", optimizer="adam", param_sharding="zero1", batch=64,
                                  strategy=strategy)
    assert device_bytes(zero1.params) == device_bytes(replicated.params)
    assert device_bytes(zero1.opt_state) < device_bytes(replicated.opt_state) / 8 * 1.05
    grads: dict = {}
    for c in gpu.analysis.collectives(text):
        if c["kind"] != "all-reduce":  # those: the small replicated leaves, the loss, the metrics
            grads[c["kind"]] = grads.get(c["kind"], 0) + c["bytes"]
    # the sharded gradients reduce-scattered, their new parameters all-gathered: the same bytes, ~all of them
    assert grads.keys() == {"reduce-scatter", "all-gather"} and grads["all-gather"] > 0.95 * device_bytes(zero1.params)


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_hsdp_across_two_hosts_sends_only_an_eighth_of_the_sharded_gradients_over_the_network(gpu, strategy):
    """2 hosts x 8 H100, replica=2 x data=8: the gather and the reduce-scatter stay on NVLink, and what crosses
    the network is one all-reduce of each GPU's 1/8 shard (+ the small replicated leaves): ResNet-18's 42.6 MiB
    of sharded gradients cross as 5.4 MiB, where replicated data parallelism sends all of them."""
    import jax

    from jaxtrain.analysis.diagnostics import crossing_bytes, replica_hosts
    from jaxtrain.data import sources
    from jaxtrain.gpu import analysis
    from jaxtrain.driver import assemble

    mesh = gpu.mesh_for("h100", 8, hosts=2, axes={"replica": 2, "data": 8})
    assert replica_hosts(mesh) == [0] * 8 + [1] * 8
    c = RunConfig(devices=16, mesh={"replica": 2, "data": 8}, model="resnet18", optimizer="adam",
                  param_sharding="hsdp", strategy=strategy)
    model = assemble.model(c.network, c.compute, sources.shape_of(c.dataset))
    trainer = assemble.steps(c.network, c.optim, c.parallel, mesh, model, updates=0)[0]
    state = trainer.abstract_state(init_fn=model.init)
    text = trainer.lower(state, model.batch_shapes(256)).compile(compiler_options=analysis.AUTOTUNER_OFF).as_text()
    across = crossing_bytes(text, replica_hosts(mesh))

    def nbytes(x):
        return x.size * x.dtype.itemsize

    grads = sum(nbytes(x) for x in jax.tree.leaves(state.params))  # what replicated all-reduces across hosts
    sharded = sum(nbytes(x) for x in jax.tree.leaves(state.params) if not x.sharding.is_fully_replicated)
    assert set(across) == {"all-reduce"}  # no gather, no reduce-scatter crosses hosts
    assert sharded / 8 < across["all-reduce"]["bytes"] < sharded / 8 + (grads - sharded) + 2**20
    assert across["all-reduce"]["bytes"] < grads / 7
    every = {c["kind"] for c in gpu.analysis.collectives(text)}
    assert {"all-gather", "reduce-scatter"} <= every  # within a host, on NVLink


def test_tensor_parallelism_all_reduces_over_the_model_axis(gpu):
    _, _, _, text = _compiled(gpu, mesh_axes={"data": 4, "model": 2}, model="lenet", param_sharding="tp", batch=64)
    # groups of the 2 "model" devices: 4 groups of 2 neighbours (the mesh is (data, model)), or the mesh form
    assert re.search(r"all-reduce(-start)?\(.*replica_groups=(\[4,2\]<=\[8\]|mesh\[[^\]]*\] \{'model'\})", text)


def test_the_pipeline_passes_activations_between_stages(gpu):
    _, _, _, text = _compiled(gpu, mesh_axes={"data": 2, "stage": 4}, model="vit", microbatches=4, batch=64)
    assert any(c["kind"] == "collective-permute" and c["in_loop"] for c in gpu.analysis.collectives(text))


def test_the_gpt_attends_with_cudnns_fused_kernel_in_bf16_and_xlas_in_fp32(gpu):
    """The GPT built for an H100 (compute capability 9.0) takes cuDNN's fused attention in bf16, forward and
    backward (``gpt.fused_attention``; JAX's own default is XLA's); in fp32, XLA's."""
    text_run = dict(model="gpt", dataset="text:README.md", tokenizer="bytes", model_size="tiny", seq_len=64,
                    shape={"input_shape": (64,), "num_classes": 256}, batch=64)
    fused = gpu.analysis.kernels(_compiled(gpu, precision="bf16", **text_run)[3])["cudnn"]
    assert {"fmhaSoftmax", "fmhaSoftmaxBackward"} <= set(fused), fused
    assert not any("fmha" in k for k in gpu.analysis.kernels(_compiled(gpu, **text_run)[3])["cudnn"])


def test_bf16_convolutions_go_to_cudnn_in_bf16(gpu):
    _, _, _, text = _compiled(gpu, model="lenet", precision="bf16")
    kernels = gpu.analysis.kernels(text)
    assert set(kernels["cudnn"]) == {"convBiasActivationForward", "convBackwardInput", "convBackwardFilter"}
    assert re.search(r'= \(bf16\[[\d,]+\]\{[\d,]+\}, u8\[\d+\]\{0\}\) custom-call\(.*"__cudnn\$conv', text)


def test_remat_lowers_the_compiled_temp_memory(gpu):
    """On the ViT's stack of identical blocks (docs/gpu.md: 386.18 MiB none, 180.51 dots, 58.79 full at 1024).
    LeNet peaks in its first layer's backward, its activation and gradient both live whatever is
    rematerialised, so there remat leaves XLA:GPU's temps as they are (docs/gpu.md)."""
    temps = {remat: _compiled(gpu, model="vit", remat=remat, batch=1024)[2].memory_analysis().temp_size_in_bytes
             for remat in ("none", "dots", "full")}
    assert temps["full"] < 0.25 * temps["none"] and temps["dots"] < 0.6 * temps["none"], temps


def test_offloading_moves_the_vits_saved_values_to_pinned_host_memory_and_times_the_transfers(gpu):
    """The scan over the ViT's layers stacks each layer's offloaded values into host buffers (XLA's memory space 5):
    device temps fall, host memory holds them, and each crosses the host link once each way per step."""
    plans = {r: gpu.plan("h100", 8, model="vit", precision="bf16", remat=r, batch_size=2048, largest_batch=False)
             for r in ("none", "offload_names:mlp_hidden,attention")}
    none, off = plans["none"], plans["offload_names:mlp_hidden,attention"]
    stacked = 8 * 256 * 49 * (64 + 128) * 2  # layers x per-GPU batch x tokens x (attention + mlp_hidden) x bf16
    assert none.memory["host"] == 0 and off.memory["host"] == stacked
    assert off.memory["temps"] < 0.2 * none.memory["temps"], (off.memory, none.memory)
    assert off.estimate["to_host"] == off.estimate["from_host"] == stacked and none.estimate["to_host"] == 0
    pcie = stacked * 2 / (gpu.target("h100").host_link_gbps * 1e9)
    assert off.estimate["host_seconds"] >= pcie and off.estimate["seconds"] > none.estimate["seconds"]


@pytest.mark.parametrize(("name", "kernels_per_step"), [("lenet", 2)])
def test_the_pallas_kernels_compile_to_gpu_code(gpu, name, kernels_per_step):
    _, _, _, text = _compiled(gpu, model=name, kernels="pallas")
    kernels = gpu.analysis.kernels(text)
    assert kernels["pallas_kernels"] == kernels_per_step  # forward and backward
    assert kernels["pallas_backends"] == {"mosaic": kernels_per_step}  # H100 (sm_90): Mosaic GPU, not Triton
    assert "while(" not in text  # not the CPU's interpret-mode loop


def test_the_ring_strategy_compiles_in_fp32(gpu):
    """In fp32: in bf16 this compile took 284-358 s on a 2-core host (jax 0.12.0.1, 2026-11-23), 155 s of it in
    XLA:GPU's autotuning config pass."""
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
    assert 3.3e9 / 8 < p.flops < 3.6e9 / 8  # 3.43 GFLOP for the whole step, convolutions included (README's table)
    assert p.largest_batch is not None and p.largest_batch_bytes <= p.budget_bytes < p.search[-1][1] or \
        p.largest_batch >= p.max_batch
    assert "FITS" in p.format() and "all-reduce" in p.format()
    assert p.to_json()["memory"]["params"] == p.memory["params"]


def test_a_kept_program_is_read_back_only_for_the_same_inputs_and_gives_the_same_estimate(gpu, tmp_path, caplog):
    """gpu_validate's folder of compiled programs (analysis.compiled_text): the first compile keeps the text, the
    same step for the same target reads it back (the same estimate); another target, or a changed step,
    compiles anew; an unreadable entry is compiled again, saying so."""
    from jaxtrain.gpu.plan import estimated, lowered_step

    where = dict(gpus=2, hosts=1, model="lenet", precision="bf16", batch_size=64)
    first, kept = estimated(tmp_path, gpu="h100", **where)
    assert not kept and len(list(tmp_path.glob("*.hlo.gz"))) == 1
    again, kept = estimated(tmp_path, gpu="h100", **where)
    assert kept and again == first
    compiled = lowered_step(gpu="h100", **where)
    assert compiled.estimate(compiled.lowered.compile().as_text()) == first  # what a compile gives
    assert not estimated(tmp_path, gpu="a100", **where)[1]  # another target
    assert not estimated(tmp_path, gpu="h100", **{**where, "batch_size": 128})[1]  # another program
    assert len(list(tmp_path.glob("*.hlo.gz"))) == 3
    import gzip

    entries = sorted(tmp_path.glob("*.hlo.gz"))
    whole = entries[0].read_bytes()
    damaged = {"not gzip": b"not gzip", "empty": b"", "no program": gzip.compress(b"HloModule x"),
               "a flipped body": whole[:20] + bytes(b ^ 0xFF for b in whole[20:60]) + whole[60:]}
    for why, content in damaged.items():
        for entry in entries:
            entry.write_bytes(content)
        caplog.clear()
        with caplog.at_level("WARNING", logger="jaxtrain.gpu.analysis"):
            assert estimated(tmp_path, gpu="h100", **where) == (first, False), why
        assert "unreadable" in caplog.text and "compiling it again" in caplog.text, why
        assert estimated(tmp_path, gpu="h100", **where) == (first, True), why


def test_the_offload_table_command_prints_a_row_per_policy(capsys, tmp_path):
    from experiments import gpu_offload

    assert gpu_offload.main(["--models", "lenet", "--no-search", "--json", str(tmp_path / "t.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| lenet |")]
    assert [r.split(" | ")[1] for r in rows] == list(gpu_offload.POLICIES["lenet"])
    assert "| 0 | n/a |" in rows[0] and "| 0 | n/a |" not in rows[-1]  # offload_dots moves bytes to the host
    assert (tmp_path / "t.json").exists()


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


# ---------------------------------------------------------------- the step-time estimate (jaxtrain.gpu.estimate)


def _program(gpu, fn, *shapes, gpus=1, spec=None):
    """The compiled HLO text of ``fn`` over ``shapes`` on ``gpus`` H100s (inputs sharded by ``spec``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = gpu.mesh_for("h100", gpus)
    sharding = NamedSharding(mesh, spec or PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=gpu.analysis.AUTOTUNER_OFF)
    return compiled.as_text()


def test_a_matmul_is_estimated_at_the_dense_peak_of_its_dtype(gpu):
    import jax.numpy as jnp

    from jaxtrain.gpu.estimate import estimate

    n = 4096
    e = estimate(_program(gpu, lambda a, b: a @ b, ((n, n), jnp.bfloat16), ((n, n), jnp.bfloat16)), "h100", 1, 1, 1)
    flops, peak = 2 * n**3, gpu.target("h100").peak_tflops["bf16"] * 1e12
    assert e.flops == flops and e.peak_flops == peak
    assert e.lower_bound == pytest.approx(flops / peak, rel=1e-3)  # 139 us: compute-bound (100 MB at 3.35 TB/s: 30 us)
    costs = gpu.targets.costs()
    assert e.seconds == pytest.approx(flops / peak / costs.efficiency + costs.launch_us * 1e-6, rel=1e-3)
    assert e.bottleneck == "compute" and e.costliest(1)[0].kind == "matmul"


def test_an_elementwise_op_is_estimated_at_the_memory_bandwidth(gpu):
    import jax.numpy as jnp

    from jaxtrain.gpu.estimate import estimate

    n = 2**24
    e = estimate(_program(gpu, lambda x: x * 2 + 1, ((n,), jnp.float32)), "h100", 1, 1, 1)
    bandwidth = gpu.target("h100").memory_bandwidth_gbps * 1e9
    assert e.flops == 0 and e.lower_bound == pytest.approx(2 * 4 * n / bandwidth, rel=1e-6)  # read + write
    assert e.bottleneck == "memory"


def test_an_in_place_update_counts_only_the_slice_it_writes(gpu):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxtrain.gpu.estimate import estimate

    sharding = NamedSharding(gpu.mesh_for("h100", 1), PartitionSpec())
    buffer = jax.ShapeDtypeStruct((64, 2**20), jnp.float32, sharding=sharding)  # 256 MiB, donated: updated in place
    row = jax.ShapeDtypeStruct((1, 2**20), jnp.float32, sharding=sharding)
    update = jax.jit(lambda b, r, i: jax.lax.dynamic_update_slice(b, r * 2, (i, 0)), donate_argnums=0)
    text = update.lower(buffer, row, jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)).compile(
        compiler_options=gpu.analysis.AUTOTUNER_OFF).as_text()
    e = estimate(text, "h100", 1, 1, 1)
    moved = sum(o.bytes for o in e.ops)
    assert 2 * 4 * 2**20 <= moved < 3 * 4 * 2**20, e.ops  # the row read and written, not the 256 MiB buffer


def test_an_all_reduce_is_estimated_by_nccls_ring_over_nvlink(gpu):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxtrain.gpu.estimate import estimate

    mesh = gpu.mesh_for("h100", 8)
    psum = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    n = 2**22
    e = estimate(_program(gpu, psum, ((8, n), jnp.float32), gpus=8, spec=P("data")), "h100", 8, 1, 1)
    costs, link = gpu.targets.costs(), gpu.target("h100").nvlink_gbps / 2 * 1e9
    size, steps = 4 * n, 2 * 7
    expected = min((p["base_us"] + steps * p["nvlink_hop_us"]) * 1e-6 + size * steps / 8 / (link * p["bandwidth_share"])
                   for p in costs.protocols["ring"].values())
    # ~118 us: 28 MB over 450 GB/s + 14 hops (a tree, capped at 110 GB/s of bus bandwidth, would be slower)
    assert e.communication == pytest.approx(expected, rel=1e-6)
    # Across 2 hosts the ring crosses the network (50 GB/s per GPU): slower.
    e2 = estimate(_program(gpu, psum, ((8, n), jnp.float32), gpus=8, spec=P("data")), "h100", 4, 2, 1)
    assert e2.communication > 5 * e.communication


def test_more_gpus_never_add_compute_per_gpu_and_a_slower_link_never_speeds_a_step(gpu):
    import dataclasses

    from jaxtrain.gpu.estimate import estimate

    plans = [gpu.plan("h100", n, largest_batch=False, model="lenet", batch_size=256) for n in (1, 2, 4, 8)]
    flops = [p.estimate["flops"] for p in plans]
    assert all(a >= b for a, b in zip(flops, flops[1:])), flops
    _, _, _, text = _compiled(gpu, model="lenet")
    t = gpu.target("h100")
    times = [estimate(text, dataclasses.replace(t, nvlink_gbps=bw), 8, 1, 256).seconds for bw in (900, 90, 9)]
    assert times[0] <= times[1] <= times[2] and times[0] < times[2], times


def test_the_validation_table_has_a_row_per_published_cell_one_fitted():
    from experiments import gpu_validate as v
    from experiments.gpu_check_report import kept_runs

    cells = v.figures(kept_runs())
    fake = {key: {"examples_per_second": 2.0 * published, "bottleneck": "memory", "exposed": 1.0, "seconds": 10.0}
            for key, published in cells.items()}
    table = v.rows(fake, cells)
    assert [(r["gpu"], r["gpus"], r["precision"]) for r in table][:4] == [
        ("a100", 1, "TF32"), ("a100", 1, "AMP"), ("a100", 8, "TF32"), ("a100", 8, "AMP")]
    assert len(table) == 14 and [r["held_out"] for r in table].count(False) == 1  # 8 NVIDIA, 2 MLPerf, 4 jaxtrain
    assert {r["ratio"] for r in table} == {2.0}
    assert {(r["gpu"], r["gpus"], r["batch_per_gpu"]) for r in table if "MLPerf" in r["precision"]} == {
        ("h100", 8, 400), ("h200", 8, 400)}  # MLPerf Training v3.0 and v4.0's ResNet-50 rows, held out
    text = v.format_rows(table).splitlines()
    assert len(text) == 16 and "| fitted;" in text[3] and "10.0% of the step waits" in text[4]
    # The fit inverts the estimate: a kernel time R at efficiency f plus launches L takes R / f + L.
    assert v.fit_efficiency(roofline=0.06, launch=0.001, seconds=0.06 / 0.5 + 0.001) == pytest.approx(0.5)


def test_gpu_plan_scaling_prints_the_table_and_draws_the_plot(tmp_path):
    from conftest import run_cli

    r = run_cli("-m", "experiments.gpu_plan", "--model", "lenet", "--gpu", "h100", "--scaling", "1,2,16",
                "--plot", str(tmp_path / "s.png"), "--json", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()[:2] in ("1 ", "2 ", "16")]
    assert [row[:2] for row in rows] == [["1", "1"], ["2", "1"], ["16", "2"]], r.stdout
    assert "weak scaling" in r.stdout and "ESTIMATES" in r.stdout and rows[0][8] == "100.0%"
    assert (tmp_path / "s.png").stat().st_size > 10_000 and (tmp_path / "s.json").exists()
    bad = run_cli("-m", "experiments.gpu_plan", "--scaling", "4,12")
    assert bad.returncode == 2 and "whole nodes" in bad.stderr and "Traceback" not in bad.stderr


def _page_rows(label: str) -> list[tuple[str, list[str]]]:
    """docs/gpu-busy.md's command-buffer rows of one model: (mode, its four counts)."""
    page = (Path(__file__).parent.parent / "docs" / "gpu-busy.md").read_text().splitlines()
    first = next(i for i, line in enumerate(page) if line.startswith(f"| {label} |"))
    rows = []
    for line in page[first:first + 3]:
        _, _, mode, *counts, _ = [cell.strip() for cell in line.split("|")]
        rows.append((mode.strip("`"), counts))
    return rows


COUNTS = ("command_buffers", "captured", "host_launches", "steps_loop_trip")


@pytest.mark.parametrize(("settings", "label", "loops"), [
    ({"model": "lenet"}, "LeNet, fp32", 1),
    ({"model": "gpt", "model_size": "tiny", "precision": "bf16"}, "GPT tiny, bf16", 3),  # and its layers' two
])
def test_command_buffers_hold_what_each_mode_allows_and_a_step_loop_stays_on_the_host(gpu, settings, label, loops):
    """docs/gpu-busy.md's rows, K=8: XLA's own command buffers take most kernels; without them the host launches
    every thunk; ``loops`` cannot take the loop over the steps, whose body holds thunks none records."""
    from jaxtrain.gpu import thunks

    got = thunks.command_buffers(settings, steps=8)
    assert got["off"]["command_buffers"] == 0 and got["off"]["captured"] == 0
    assert got["xla"]["command_buffers"] > 0 and got["xla"]["steps_loop_trip"] < got["off"]["steps_loop_trip"]
    assert got["xla"]["types"] is None and {"WHILE", "CONDITIONAL", "FUSION"} <= set(got["loops"]["types"])
    assert {k: v for k, v in got["loops"].items() if k != "types"} == {k: v for k, v in got["xla"].items()
                                                                        if k != "types"}
    assert got["loops"]["loops"] == loops and got["loops"]["steps_loop_captured"] is False
    assert got["xla"]["loops_of_unknown_trips"] == 0  # every loop's trip count is known (8 steps, 2 layers)
    for mode, counts in _page_rows(label):  # the page's rows are this compile's
        assert counts == [str(got[mode][k]) for k in COUNTS], (label, mode, got[mode])


CONDITIONAL = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtrain import gpu
s = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(gpu.mesh_for("h100", 1), P()))
def f(x, w):
    x = jnp.tanh(x @ w) * 1.5 + jnp.sin(x)
    return jax.lax.cond(x.sum() > 0, lambda x: jnp.tanh(x @ w) + jnp.exp(x @ x), lambda x: x * 2, x)
jax.jit(f).lower(s, s).compile({"xla_gpu_autotune_level": 0})
"""


def test_xlas_own_command_buffers_hold_conditionals_in_this_jaxlib(gpu):
    """docs/gpu-busy.md: CONDITIONAL is among jaxlib 0.12.0.1's own types, so ``loops`` adds only WHILE there."""
    from jaxtrain.core import compat
    from jaxtrain.gpu import thunks

    def conditionals(mode):
        return [inside for t, inside in thunks._walk(thunks.dumped(compat.gpu_xla_flags(mode), CONDITIONAL).tree())
                if t.kind == "kConditional"]

    assert conditionals("xla") == [True] and conditionals("off") == [False]


LOOP_OF_KERNELS = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtrain import gpu
s = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(gpu.mesh_for("h100", 1), P()))
f = lambda x, w: jax.lax.fori_loop(0, 8, lambda i, x: jnp.tanh(x @ w) * 1.5 + x, x)
jax.jit(f).lower(s, s).compile({"xla_gpu_autotune_level": 0})
"""


def test_loops_records_a_loop_of_kernels_whole_and_xlas_own_choice_does_not(gpu):
    from jaxtrain.core import compat
    from jaxtrain.gpu import thunks

    got = {mode: thunks.summary(thunks.dumped(compat.gpu_xla_flags(mode), LOOP_OF_KERNELS).tree(), steps=8)
           for mode in ("xla", "loops")}
    assert got["loops"]["steps_loop_captured"] is True and got["loops"]["host_launches"] == 1, got
    assert got["xla"]["steps_loop_captured"] is False and got["xla"]["host_launches"] > 8, got  # 8 trips
