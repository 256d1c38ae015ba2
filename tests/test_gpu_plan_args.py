"""jaxtrain gpu-plan (python -m experiments.gpu_plan) checks its arguments before anything else, the CUDA plugin
included: a mistake is said as itself whether or not the gpu-compile extra is installed (here it is not, in the
suite's main venv)."""

import pytest

from conftest import run_cli

from jaxtrain.gpu import __main__ as gpu_plan


@pytest.mark.parametrize(("argv", "says"), [
    (["--batch-size", "0"], "jaxtrain gpu-plan: error: --batch-size 0: expected a number >= 1"),
    (["--plot", "x.png"], "jaxtrain gpu-plan: error: --plot draws a --scaling run: add --scaling 1,2,4,8"),
    (["--json", "/nonexistent-folder/plan.json"], "jaxtrain gpu-plan: error: --json /nonexistent-folder/plan.json: "
                                                   "cannot write in /nonexistent-folder (no such directory)"),
    (["--json", "."], "jaxtrain gpu-plan: error: --json . is a directory"),
])
def test_bad_arguments_are_said_before_the_plugin_check(capsys, argv, says):
    assert gpu_plan.main(["--model", "lenet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1 and "plugin" not in err, err


@pytest.mark.parametrize("fraction", ["0", "1.5", "nan", "-0.5"])
def test_a_memory_fraction_outside_0_1_is_an_argument_error(capsys, fraction):
    with pytest.raises(SystemExit) as e:
        gpu_plan.main(["--memory-fraction", fraction])
    assert e.value.code == 2
    assert f"argument --memory-fraction: expected a fraction in (0, 1], e.g. 0.75, got {fraction}" in (
        capsys.readouterr().err)


def test_help_says_each_default_once(capsys):
    with pytest.raises(SystemExit):
        gpu_plan.main(["--help"])
    out = capsys.readouterr().out
    assert out.count("(default: weak)") == 1, out


@pytest.mark.parametrize("command", [["-m", "jaxtrain", "gpu-plan"], ["-m", "jaxtrain.gpu"],
                                     ["-m", "experiments.gpu_plan"]])
def test_each_name_of_the_command_says_its_own(command):
    out = run_cli(*command, "--model", "lenet", "--batch-size", "0")
    prog = {"jaxtrain": "jaxtrain gpu-plan"}.get(command[1], f"python -m {command[1]}")
    assert out.returncode == 2 and out.stderr.startswith(f"{prog}: error: --batch-size 0"), out.stderr


@pytest.mark.parametrize("argv", [["--gpus", "0"], ["--scaling", "1,0"], ["--scaling", "1,x"]])
def test_a_malformed_argument_is_one_line_with_exit_2(capsys, argv):
    """argparse's own errors, said as the command (experiments/gpu_plan.py, now an alias, was checked with the
    other experiments in test_experiment_args)."""
    with pytest.raises(SystemExit) as e:
        gpu_plan.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1].startswith("jaxtrain gpu-plan: error: argument "), err
