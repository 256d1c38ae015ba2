"""Every command in experiments/ takes a bad argument as one line and exit 2, as the training commands do (issue 64:
``input_pipeline --workers=-1,x``, ``decode_bench --torch-python /nonexistent/python`` and ``decode_bench --rounds
0`` were tracebacks). Each command's parser runs here, in-process, on bad values: nothing is measured."""

import importlib

import pytest
from conftest import ROOT

# The commands' own parsers (``parser()``), or ``main(argv)`` where the parser is built inside it: bad values each.
BAD = {
    "batch_size": [["--devices", "x"], ["--devices", "0"], ["--accum-steps", "0"], ["--max-batch", "-1"]],
    "bench": [["--devices", "0"], ["--model", "gpt", "--seq-len", "0"], ["--model", "gpt", "--vocab", "x"],
              ["--model", "gpt", "--model-size", "huge"]],
    "bench_busy": [["steps", "--ks", "1,0"], ["steps", "--calls", "0"], ["e2e", "--epochs", "x"],
                   ["e2e", "--configs", "8:maybe"], ["e2e", "--configs", "0:on"], ["nope"]],
    "bench_gpu_plans": [["--gpu", "nope"], ["--gpus", "1,0"], ["--gpus", "x"]],
    "bench_hybrid": [["--replicas", "0"]],
    "bench_int8": [["--repeats", "0"]],
    "bench_kernels": [["--batch-size", "0"], ["--classes", "10,1"], ["--classes", "x"]],
    "bench_memory": [["--steps", "x"], ["--steps", "0"], ["--repeats", "-1"], ["--devices", "0"],
                     ["--batch-sizes", "256,0"]],
    "bench_ops": [["--repeats", "-1"]],
    "bench_pipeline": [["--stages", "0"]],
    "bench_sharding": [["--devices", "0"]],
    "bench_strategies": [["--devices", "0,2"], ["--batch-size", "0"], ["--steps", "0"], ["--repeats", "-1"]],
    "command_buffers": [["--steps-per-call", "0"], ["--batch-size", "x"], ["--precision", "fp8"]],
    "decode_bench": [["--images", "d", "--rounds", "0"], ["--images", "d", "--torch-python", "/nonexistent/python"],
                     ["--images", "d", "--workers", "1,x"], ["--images", "d", "--workers", "0"]],
    "export_weights": [["run", "w.safetensors", "--names", "nope"]],
    "gpu_check": [["--budget", "0"]],
    "gpu_offload": [["--gpus", "x"], ["--gpus", "0"]],
    "gpu_validate": [["--gpu", "nope"]],
    "input_pipeline": [["--workers=-1,x"], ["--workers", "-1"], ["--batches", "0"]],
    "quantize": [["--run", "r", "--repeats", "x"], ["--run", "r", "--repeats", "0"],
                 ["--run", "r", "--test-subset", "0"], ["--run", "r", "--batch-sizes", "1,0"]],
    "sample": [["run", "--tokens", "0"], ["run", "--temperature", "-1"], ["run", "--top-k", "x"]],
    "transfer": [["--repeats", "x"], ["--repeats", "0"], ["--sizes", "200,-1"]],
}
# Not commands of their own: run by other commands with positional arguments (decode_bench, bench_torch's server),
# or the flags the benchmarks share (harness: each benchmark's bad values are checked above).
HELPERS = {"bench_torch", "decode_dali", "decode_torch", "harness"}
# The console's commands in the checkout's spelling: their parsers are jaxtrain.cli's (jaxtrain sample, export).
CONSOLE = {"sample", "export_weights"}


@pytest.mark.parametrize("module, argv", [(m, a) for m, cases in BAD.items() for a in cases])
def test_a_bad_argument_is_one_line_with_exit_2(module, argv, capsys):
    command = importlib.import_module(f"experiments.{module}")
    with pytest.raises(SystemExit) as e:
        if hasattr(command, "parser"):
            command.parser().parse_args(argv)
        else:
            command.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"python -m experiments.{module}: error: argument "), err


def test_every_command_that_takes_arguments_is_checked_here():
    takes = {p.stem for p in (ROOT / "experiments").glob("*.py") if "add_argument(" in p.read_text()} | CONSOLE
    assert takes - HELPERS == set(BAD), sorted(takes ^ set(BAD))
