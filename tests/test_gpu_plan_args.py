"""experiments.gpu_plan checks its arguments before anything else, the CUDA plugin included: a mistake is said as
itself whether or not the gpu-compile extra is installed (here it is not, in the suite's main venv)."""

import pytest

from experiments import gpu_plan


@pytest.mark.parametrize(("argv", "says"), [
    (["--batch-size", "0"], "gpu_plan: error: --batch-size 0: expected a number >= 1"),
    (["--plot", "x.png"], "gpu_plan: error: --plot draws a --scaling run: add --scaling 1,2,4,8"),
    (["--json", "/nonexistent-folder/plan.json"], "gpu_plan: error: --json /nonexistent-folder/plan.json: cannot "
                                                   "write in /nonexistent-folder (no such directory)"),
    (["--json", "."], "gpu_plan: error: --json . is a directory"),
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
