"""The LeNet experiment's command line, end to end, as a user runs it."""

import json
import re
import sys

import pytest
from conftest import needs_fashion_mnist, run_cli

LENET = ("-m", "experiments.lenet")
SUMMARY_KEYS = {"test_acc", "train_loss", "initial_loss", "sec_per_epoch", "examples_per_sec", "devices", "steps",
                "test_examples", "params_digest", "strategy"}


@pytest.mark.slow  # a subprocess end to end (>20 s): make test runs it, CI's newest-JAX leg does not
@needs_fashion_mnist
def test_lenet_cli_end_to_end_with_max_steps(tmp_path):
    out = run_cli(*LENET, "--devices", "2", "--max-steps", "20", "--out", str(tmp_path), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    # 20 steps of d2l's LeNet are still on its initial plateau: the line says so (or, if it learned, ends there);
    # its sec/epoch is the 20 steps' rate, and says so (a new user read it as an epoch timed).
    assert re.search(r"^test acc 0\.\d\d, [\d.]+ sec/epoch \(projected from 20 steps\) on 2 devices \(cpu\)"
                     r"(; at chance \(0\.10\) and the loss did not fall: not learning .*)?$", out.stdout,
                     re.M), out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["steps"] == 20 and summary["devices"] == 2 and summary["test_examples"] == 10000
    assert len(summary["params_digest"]) == 64
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["steps"] == 20
    assert (tmp_path / "curves.png").stat().st_size > 1000


@pytest.mark.slow  # a subprocess end to end (>20 s): make test runs it, CI's newest-JAX leg does not
@needs_fashion_mnist
def test_lenet_cli_on_a_2d_mesh_with_fsdp_and_tensor_parallelism(tmp_path):
    out = run_cli(*LENET, "--devices", "4", "--mesh", "data=2,model=2", "--param-sharding", "fsdp+tp",
                  "--max-steps", "5", "--test-subset", "512", "--out", str(tmp_path), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh data=2,model=2, fsdp+tp (4 of 8 parameters sharded)" in out.stdout, out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "model": 2} and summary["param_sharding"] == "fsdp+tp"
    assert summary["sharded_params"]["dense1/w"] == "P('data', 'model')"
    assert summary["collectives"]["all-gather"]["ops"] > 0 and summary["steps"] == 5


@pytest.mark.parametrize(("flags", "fragments"), [
    (["--devices", "4", "--mesh", "data=3,model=2"], ["mesh data=3,model=2 has 6 places", "4 devices"]),
    (["--devices", "2", "--param-sharding", "tp"],
     ["names axis 'model'", "give --mesh that axis, e.g. data=2,model=2"]),
    (["--devices", "2", "--strategy", "pmap", "--param-sharding", "fsdp"], ["'pmap' keeps the whole state"]),
    (["--devices", "4", "--mesh", "data=2,model=2", "--strategy", "ring", "--param-sharding", "fsdp+tp"],
     ["'ring' shards parameters over 'data' only", "use --strategy 'jit' for tensor parallelism"]),
])
def test_bad_sharding_flags_are_one_line_errors(tmp_path, flags, fragments):
    one_line_error(run_cli(*LENET, *flags, "--out", str(tmp_path)), *fragments)


@pytest.mark.slow
def test_sharding_benchmark_smoke(tmp_path):
    out = run_cli("-m", "experiments.bench_sharding", "--model", "lenet", "--batch-size", "8", "--steps", "1",
                  "--repeats", "1", "--budget", "0", "--json", str(tmp_path / "s.json"))  # the script's smoke: LeNet
    assert out.returncode == 0, out.stderr[-3000:]
    for setting in ("replicated", "fsdp", "tp", "fsdp+tp"):
        assert re.search(rf"^ *{re.escape(setting)} +[\d.]+ ", out.stdout, re.M), out.stdout
    result = json.loads((tmp_path / "s.json").read_text())
    rows = result["settings"]
    assert rows["fsdp"]["argument_mib"] < 0.3 * rows["replicated"]["argument_mib"]
    assert result["conv"] in ("onednn", "xla")


def one_line_error(out, *fragments):
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.slow  # a subprocess end to end (~20 s): make test runs it, CI's newest-JAX leg does not
def test_a_run_names_its_convolutions_and_says_why_oneDNN_fell_back(tmp_path):
    """No compiler, a fresh oneDNN cache: one warning line (on x86-64 Linux), and the run's first line and
    summary.json say XLA's convolutions ran, and why."""
    from test_data import make_idx_dir

    from jaxtrain.kernels import onednn

    make_idx_dir(tmp_path / "idx")
    out = run_cli(*LENET, "--devices", "2", "--data-dir", str(tmp_path / "idx"), "--batch-size", "8", "--epochs",
                  "1", "--max-steps", "2", "--out", str(tmp_path / "run"), "--no-progress",
                  env={"CXX": "/nonexistent", "JAXTRAIN_ONEDNN_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr[-3000:]
    why = "no C++ compiler found (/nonexistent)" + ("" if onednn.expected() else "; not x86-64 Linux")
    first = next(line for line in out.stdout.splitlines() if line.startswith("lenet: "))  # after TFDS's lines
    assert f", conv: xla ({why}); out: " in first, out.stdout
    warnings = [line for line in out.stderr.splitlines() if "oneDNN" in line]
    assert len(warnings) == onednn.expected() and all("install g++ (make onednn" in w for w in warnings), out.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["conv"] == f"xla ({why})"


@pytest.mark.parametrize("env, fragment", [
    ({"JAXTRAIN_MALLOC": "off"}, "JAXTRAIN_MALLOC=off: unknown value: set JAXTRAIN_MALLOC=default"),
    ({"JAXTRAIN_ONEDNN_THREADS": "99999999999", "JAXTRAIN_MALLOC": None},
     "JAXTRAIN_ONEDNN_THREADS=99999999999: must be a whole number from 1 to"),
])
def test_a_bad_jaxtrain_variable_is_a_one_line_error(tmp_path, env, fragment):
    """Before the data is read: the model is made (and oneDNN's thread count checked) first."""
    from jaxtrain.kernels import onednn

    if "JAXTRAIN_ONEDNN_THREADS" in env and not onednn.available():
        pytest.skip(f"the thread count is read where oneDNN's convolutions run: {onednn.reason()}")
    out = run_cli(*LENET, "--devices", "1", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path), env=env)
    one_line_error(out, fragment)


def test_vit_layers_that_do_not_split_into_the_stages_say_which_flags_would(tmp_path):
    """It asked for "a layer count that is a multiple of 3", which no flag sets."""
    out = run_cli("-m", "experiments.vit", "--devices", "3", "--mesh", "stage=3", "--microbatches", "3",
                  "--out", str(tmp_path))
    one_line_error(out, "8 layers do not split into 3 stages x 1 repeats",
                   "use a 'stage' axis of 2, 4 or 8 (--mesh) with --repeats 1")


def test_indivisible_batch_is_a_one_line_error(tmp_path):
    out = run_cli(*LENET, "--devices", "2", "--batch-size", "255", "--out", str(tmp_path))
    one_line_error(out, "batch size 255", "multiple of 2")


def test_missing_data_dir_is_a_one_line_error(tmp_path):
    out = run_cli(*LENET, "--devices", "1", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"))
    one_line_error(out, "nowhere", "make data")


@pytest.mark.parametrize("flags, fragment", [(["--epochs", "0"], "--epochs"), (["--strategy", "nccl"], "--strategy"),
                                             (["--lr", "-1"], "--lr"), (["--mesh", "data:2"], "--mesh"),
                                             (["--mesh", "data=2,foo=2"], "unknown axis 'foo'"),
                                             (["--microbatches", "4"], "give --mesh a 'stage' axis"),
                                             (["--max-steps", "5", "--profile", "10:12"], "starts after --max-steps"),
                                             (["--param-sharding", "zero"], "--param-sharding"),
                                             # issue 64: accepted, then "diverged" (exit 3)
                                             (["--lr", "inf"], "--lr inf: expected a finite number"),
                                             (["--lr", "nan"], "--lr nan: expected a finite number"),
                                             (["--lr-groups", "dense/=inf"], "'dense/=inf' is not one"),
                                             # a new user's findings: a traceback, a run in the current folder,
                                             # a flag taken for another, or one that did nothing
                                             (["--seed", "-1"], "--seed -1: expected a number >= 0"),
                                             (["--out", ""], "--out '': empty; give a value"),
                                             (["--epoch", "1"], "unrecognized arguments: --epoch 1"),
                                             (["--model", "gpt"], "unrecognized arguments: --model gpt"),
                                             (["--coordinator", "localhost:1234"], "--coordinator localhost:1234: "
                                              "for a multi-process run; give --num-processes too")])
def test_bad_flags_exit_2(flags, fragment):
    out = run_cli(*LENET, *flags)
    assert out.returncode == 2 and fragment in out.stderr and "Traceback" not in out.stderr


def test_help_explains_every_flag():
    out = run_cli(*LENET, "--help")
    assert out.returncode == 0
    assert "(default: None)" not in out.stdout and "(default: mini) (default" not in out.stdout  # each said once
    assert "(default: 10)" in out.stdout  # the recipe's epochs, where the flag's help says "the model's recipe"
    for flag in ("--devices", "--epochs", "--batch-size", "--lr", "--seed", "--dataset", "--data-dir", "--out",
                 "--max-steps", "--strategy", "--param-sharding", "--mesh"):
        assert flag in out.stdout


def test_help_lists_the_models_own_flags():
    # a new user's finding: lenet's --help listed a language model's flags; a fixed model's lists its kind's only,
    # and a flag of the other kind is still refused in one line that says whose it is
    from jaxtrain.cli import make_parser

    lenet, gpt, every = (make_parser(m).format_usage() for m in ("lenet", "gpt", None))
    for name in ("--seq-len", "--rotary", "--tokenizer", "--vocab-size", "--model-size"):
        assert f"[{name}" not in lenet and f"[{name}" in gpt and f"[{name}" in every
    for name in ("--image-size", "--classes", "--augment", "--on-bad-image"):
        assert f"[{name}" in lenet and f"[{name}" not in gpt and f"[{name}" in every
    assert "python -m jaxtrain.cli --help lists every flag" in " ".join(make_parser("lenet").format_help().split())
    out = run_cli(*LENET, "--seq-len", "64", "--max-steps", "1")
    assert out.returncode == 2 and "--seq-len is for a language model's text" in out.stderr, out.stderr


@needs_fashion_mnist
@pytest.mark.slow
def test_input_pipeline_experiment_smoke():
    out = run_cli("-m", "experiments.input_pipeline", "--devices", "2", "--max-steps", "3", "--workers", "0,1",
                  "--slow-ms", "5")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| none") or line.startswith("| sleep")]
    assert len(rows) == 8, out.stdout


@pytest.mark.slow  # a subprocess end to end (>20 s): make test runs it, CI's newest-JAX leg does not
def test_strategy_benchmark_smoke(tmp_path):
    out = run_cli("-m", "experiments.bench_strategies", "--devices", "1,2", "--steps", "2", "--repeats", "1",
                  "--batch-size", "64", "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("| ring |") == 1 and (tmp_path / "b.json").exists()


@pytest.mark.slow  # a subprocess end to end (>20 s): make test runs it, CI's newest-JAX leg does not
def test_memory_benchmark_smoke():
    out = run_cli("-m", "experiments.bench_memory", "--model", "lenet", "--devices", "2", "--batch-sizes", "32",
                  "--precisions", "fp32", "--remats", "none,full", "--steps", "1", "--repeats", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| 32 | fp32 | none |" in out.stdout and "| 32 | fp32 | full |" in out.stdout


@pytest.mark.slow  # a subprocess end to end (>20 s): make test runs it, CI's newest-JAX leg does not
@needs_fashion_mnist
def test_resnet18_cli_trains(tmp_path):
    out = run_cli("-m", "experiments.resnet18", "--devices", "2", "--max-steps", "4", "--batch-size", "16",
                  "--train-subset", "512", "--test-subset", "64", "--param-sharding", "fsdp", "--strategy", "shard_map",
                  "--out", str(tmp_path), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["experiment"] == "resnet18" and summary["steps"] == 4 and summary["train_examples"] == 512
    assert summary["param_sharding"] == "fsdp" and summary["collectives"]["reduce-scatter"]["ops"] > 0
    assert summary["test_examples"] == 64 and summary["train_loss"] > 0


@needs_fashion_mnist
@pytest.mark.slow
@pytest.mark.parametrize("model", ["lenet"])  # bench.py is model-agnostic (the registry); ResNet-18's model path
def test_bench_smoke(tmp_path, model):          # is test_runner's registry smoke and test_resnet18_cli_trains
    size = [] if model == "lenet" else ["--batch-size", "8", "--no-torch"]
    out = run_cli("-m", "experiments.bench", "--model", model, "--repeats", "2", "--steps", "2", "--epoch-steps", "2",
                  "--devices", "1", *size, "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert {"jaxtrain_ms", "handwritten_ms", "torch_ms", "peak_gflops"} <= result.keys()
    assert result["model"] == model and result["batch_size"] == (256 if model == "lenet" else 8)
    assert result["devices"] == 1 and result["materialize"] is True and " 1 cpu devices " in out.stdout
    assert result["flops_per_step"] > 0 and result["bytes_per_step"] > 0 and "H100" in out.stdout
    assert result["jaxtrain_ms"] > 0 and result["handwritten_ms"] > 0 and result["peak_gflops"] > 0
    assert "| jaxtrain |" in out.stdout and "jaxtrain/handwritten" in out.stdout
    from jaxtrain.parallel import host_memory

    assert result["malloc_kept"] is host_memory.wanted()  # and PyTorch is timed both with its malloc and with ours
    assert (result["torch_same_malloc_ms"] is not None) is (result["torch_ms"] is not None and host_memory.wanted())


@needs_fashion_mnist
@pytest.mark.slow
def test_bench_bf16_smoke(tmp_path):
    out = run_cli("-m", "experiments.bench", "--precision", "bf16", "--repeats", "2", "--steps", "2", "--epoch-steps",
                  "2", "--devices", "2", "--no-torch", "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["precision"] == "bf16" and result["devices"] == 2 and "LeNet bf16 train step" in out.stdout
    assert result["jaxtrain_ms"] > 0 and result["handwritten_ms"] > 0 and result["paired_jaxtrain_over_handwritten"] > 0
    # MFU beside HFU: the model's training FLOPs (3 x forward) and the compiled program's, over the same peak
    from jaxtrain.models.flops import forward

    assert result["model_flops_per_example"] == 3 * forward("lenet", (28, 28, 1), 10)
    assert result["jaxtrain_mfu"] / result["jaxtrain_hfu"] == pytest.approx(
        result["model_flops_per_example"] * result["batch_size"] / result["flops_per_step"])
    assert "| MFU | HFU |" in out.stdout


@pytest.mark.slow
def test_bench_int8_times_inference_on_one_device(tmp_path):
    out = run_cli("-m", "experiments.bench", "--precision", "int8", "--repeats", "2", "--steps", "2", "--no-torch",
                  "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["precision"] == "int8" and result["devices"] == 1 and "LeNet int8 inference" in out.stdout
    assert result["jaxtrain_ms"] > 0 and result["jaxtrain_fp32_ms"] > 0 and result["handwritten_ms"] is None
    assert result["paired_int8_over_fp32"] > 0 and "epoch_wall_sec" not in result
    assert "| jaxtrain_fp32 |" in out.stdout and "jaxtrain int8/fp32" in out.stdout


def test_bench_int8_of_a_model_quantize_does_not_cover_is_a_one_line_error():
    from experiments.bench import INT8_MODELS
    from jaxtrain.analysis.quantize import MODELS

    assert INT8_MODELS == MODELS
    out = run_cli("-m", "experiments.bench", "--model", "vit", "--precision", "int8", "--no-torch")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("bench: error: --precision int8 covers lenet, resnet18 (jaxtrain.analysis.quantize), "
                                  "not vit")


def test_bench_of_a_model_pytorch_lacks_is_a_one_line_error():
    pytest.importorskip("torch")
    out = run_cli("-m", "experiments.bench", "--model", "vit")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "bench: error: the PyTorch side exists for lenet, resnet18: pass --no-torch for vit"


def test_bench_int8_on_several_devices_is_a_one_line_error():
    out = run_cli("-m", "experiments.bench", "--precision", "int8", "--devices", "2")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "bench: error: --precision int8 times inference on one device: drop --devices"


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8", "fp32-infer"])
def test_torch_worker_modes(mode):
    pytest.importorskip("torch")
    from experiments.bench_torch import TorchWorker

    worker = TorchWorker("lenet", 8, mode=mode)
    try:
        assert worker.time(2) > 0
    finally:
        worker.close()


@pytest.mark.slow
@pytest.mark.parametrize("torch", ["--no-torch", None])
def test_bench_ops_smoke(torch):
    out = run_cli("-m", "experiments.bench_ops", "--batch-size", "32", "--repeats", "2", *([torch] if torch else []))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| conv")]
    assert len(rows) == 5 and all(float(r.split("|")[2]) > 0 for r in rows), out.stdout
    if torch:  # the path CI takes (no PyTorch installed)
        assert all(r.rstrip().endswith("| n/a |") for r in rows), out.stdout


def test_bench_torch_python_without_torch_is_a_one_line_error():
    out = run_cli("-m", "experiments.bench", "--torch-python", sys.executable + "-missing")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"bench: error: --torch-python {sys.executable}-missing cannot import torch"


@pytest.mark.parametrize("module", ["experiments.bench", "experiments.bench_ops"])
def test_bench_bad_count_is_a_one_line_error(module):
    out = run_cli("-m", module, "--repeats", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--repeats" in out.stderr and ">= 1" in out.stderr, out.stderr


def test_launcher_exits_128_plus_signal_when_a_worker_is_killed():
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    out = run_cli("-m", "jaxtrain.launch", "--processes", "2", "--", sys.executable, "-c", kill_self, timeout=120)
    assert out.returncode == 128 + 9, (out.returncode, out.stderr)
    assert "was killed by SIGKILL; stopping the others" in out.stderr


@needs_fashion_mnist
def test_a_resume_under_other_program_settings_says_which_in_its_line(tmp_path):
    """The variables read while the step is traced (and $XLA_FLAGS) change the compiled program: they were in
    neither the config nor the checkpoint, so a resume under others compiled another program without a word."""
    def lenet(max_steps, **env):
        return run_cli(*LENET, "--devices", "1", "--max-steps", str(max_steps), "--batch-size", "64",
                       "--train-subset", "256", "--test-subset", "64", "--checkpoint-every", "2", "--no-progress",
                       "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / f"o{max_steps}"),
                       *(["--resume"] if max_steps > 2 else []), env=env)

    first = lenet(2)
    assert first.returncode == 0, first.stderr[-3000:]
    recorded = json.loads((tmp_path / "o2" / "model.json").read_text())["settings"]
    assert recorded["JAXTRAIN_NO_MATERIALIZE"] is False and recorded["JAXTRAIN_PALLAS_GPU"] == "auto"
    assert recorded["JAXTRAIN_COMMAND_BUFFERS"] == "xla"
    assert "XLA_FLAGS" in recorded
    same = lenet(3)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "resuming from step 2 (epoch 1, batch 2); changed since: max_steps 2 -> 3\n" in same.stdout, same.stdout
    other = lenet(4, JAXTRAIN_NO_MATERIALIZE="1", JAXTRAIN_PALLAS_GPU="triton", JAXTRAIN_COMMAND_BUFFERS="off")
    assert other.returncode == 0, other.stderr[-3000:]
    assert ("resuming from step 3 (epoch 1, batch 3); changed since: max_steps 3 -> 4, JAXTRAIN_NO_MATERIALIZE "
            "False -> True, JAXTRAIN_PALLAS_GPU 'auto' -> 'triton', JAXTRAIN_COMMAND_BUFFERS 'xla' -> 'off'\n"
            ) in other.stdout, other.stdout


@pytest.mark.slow
@needs_fashion_mnist
def test_resume_under_another_mesh_and_sharding_goes_on_where_the_run_stopped(tmp_path):
    def lenet(max_steps, *flags):
        return run_cli(*LENET, "--max-steps", str(max_steps), "--batch-size", "64", "--train-subset", "2048",
                       "--test-subset", "512", "--checkpoint-every", "4", "--no-progress", *flags)

    ck = str(tmp_path / "ck")
    first = lenet(4, "--devices", "4", "--param-sharding", "fsdp", "--checkpoint-dir", ck, "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = lenet(8, "--devices", "2", "--checkpoint-dir", ck, "--resume", "--out", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("resuming from step 4 (epoch 1, batch 4); changed since: devices 4 -> 2, param_sharding 'fsdp' -> "
            "'replicated', max_steps 4 -> 8") in resumed.stdout, resumed.stdout
    straight = lenet(8, "--devices", "4", "--param-sharding", "fsdp", "--checkpoint-dir", str(tmp_path / "ck2"),
                     "--out", str(tmp_path / "c"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    got, want = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("b", "c"))
    assert got["steps"] == want["steps"] == 8
    # Float re-association differs between the meshes; the run is the same run.
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-4)


def test_a_checkpoint_dir_overlapping_the_out_dir_is_refused(tmp_path):
    """--checkpoint-dir inside OUT/model (which the export rewrites) or equal to --out was accepted."""
    from jaxtrain.errors import ConfigError
    from jaxtrain.driver.config import RunConfig

    out = tmp_path / "run"
    for ck in (out, out / "model", out / "model" / "ck", tmp_path):  # the last: --out inside the checkpoint dir
        with pytest.raises(ConfigError, match=r"checkpoint_dir=.* and out=.* overlap .*use separate"):
            RunConfig(model="lenet", out=str(out), checkpoint_dir=str(ck))
    RunConfig(model="lenet", out=str(out), checkpoint_dir=str(out / "checkpoints"))  # beside model/: fine


def test_a_checkpoint_dir_that_is_another_runs_out_is_refused(tmp_path):
    """A new user's finding: --checkpoint-dir at a finished GPT run's --out was taken, and LeNet's step folders
    sat beside the GPT's model (--out there is refused: it holds another run's results)."""
    from jaxtrain.driver import build
    from jaxtrain.driver.sections import Checkpoints
    from jaxtrain.errors import ConfigError

    other = tmp_path / "gpt1"
    other.mkdir()
    (other / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"checkpoint_dir=.*gpt1 holds a run's results \(it is a run's out=\): give "
                                          r"the checkpoints a directory of their own, e.g. checkpoint_dir=.*gpt1/ch"):
        build.open_checkpoints(Checkpoints(checkpoint_dir=str(other)))
    build.open_checkpoints(Checkpoints(checkpoint_dir=str(other / "checkpoints"))).close()  # a directory of its own


def test_runs_lists_every_experiment_that_is_a_training_run_and_the_model_it_fixes(monkeypatch):
    """``cli.RUNS`` (what ``python -m jaxtrain.slurm`` parses a command with) is exactly the experiments whose main
    is the run's (``jaxtrain.cli.main``), each with the model it passes: a new training experiment is not forgotten."""
    import ast
    import runpy

    from conftest import ROOT

    from jaxtrain import cli

    runs = {f"experiments.{p.stem}" for p in (ROOT / "experiments").glob("*.py")
            if any(isinstance(node, ast.ImportFrom) and node.module == "jaxtrain.cli"
                   and any(a.name == "main" for a in node.names) for node in ast.walk(ast.parse(p.read_text())))}
    assert runs == set(cli.RUNS) - {"jaxtrain.cli"}, sorted(runs ^ (set(cli.RUNS) - {"jaxtrain.cli"}))
    for module in sorted(runs):  # run as python -m MODULE would, its main a stand-in that says what it was given
        given = []
        monkeypatch.setattr(cli, "main", lambda model=None, *args, **kwargs: given.append(model) or 0)
        monkeypatch.setattr(sys, "argv", [module, "--teacher", "t", "--student", "lenet"])  # distill asks for them
        with pytest.raises(SystemExit):
            runpy.run_module(module, run_name="__main__")
        assert given == [cli.RUNS[module]], (module, given)


@pytest.mark.parametrize("propagating", [True, False])
def test_a_library_line_is_said_once_when_library_log_is_nested_and_propagate_is_given_back(capsys, propagating):
    """A command's ``one_line_errors`` around a main that says the library's lines too (``cli.main``): said once,
    naming the outer one's flags; the logger's ``propagate`` is what it was before, not always True."""
    import logging

    from jaxtrain import cli, errors

    logger = logging.getLogger("jaxtrain")
    before, handlers, logger.propagate = logger.propagate, list(logger.handlers), propagating

    @cli.one_line_errors("prog", {"budget_bytes": "--memory-budget"})
    def command(argv):
        with cli.library_log():  # as cli.main does
            logging.getLogger("jaxtrain.test").warning("%s is small", errors.named("budget_bytes", 3))
        return 0

    try:
        capsys.readouterr()
        assert command([]) == 0
        assert capsys.readouterr().err.splitlines() == ["warning: --memory-budget 3 is small"]
        assert logger.propagate is propagating and logger.handlers == handlers
    finally:
        logger.propagate = before


def test_out_of_memory_is_one_line_saying_what_to_change(monkeypatch, capsys):
    # a new user's finding: a GPT too large for the host ended in XLA's RESOURCE_EXHAUSTED traceback
    import jax

    from jaxtrain import cli
    from jaxtrain.driver import runner

    def too_large(config, stop):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 132588959928 bytes.\nmore")

    monkeypatch.setattr(runner, "run", too_large)
    assert cli.main("lenet", ["--max-steps", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m experiments.lenet: error: out of memory (RESOURCE_EXHAUSTED: "
                                               "Out of memory allocating 132588959928 bytes.): "), err
    assert "--batch-size" in err[0]
