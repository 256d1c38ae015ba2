"""Device set-up and mesh: counts, errors, and the CLI's one-line failures."""

import jax
import pytest
from conftest import run_cli

import jaxtrain as jt
from jaxtrain.devices import max_cpu_devices


def test_setup_devices_matches_running_backend():
    assert len(jt.setup_devices(4)) == 4  # conftest started JAX with 4
    assert len(jt.setup_devices()) == 4


def test_setup_devices_after_start_with_other_count_says_what_to_do():
    with pytest.raises(jt.ConfigError, match=r"already started with 4 CPU devices.*JAX_NUM_CPU_DEVICES=2"):
        jt.setup_devices(2)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_setup_devices_rejects_non_positive(bad):
    with pytest.raises(jt.ConfigError, match="positive whole number"):
        jt.setup_devices(bad)


def test_make_mesh_from_int_and_list():
    mesh = jt.make_mesh(2)
    assert mesh.axis_names == (jt.DATA_AXIS,) and mesh.devices.size == 2
    assert jt.make_mesh(jax.devices()[1:4]).devices.size == 3
    with pytest.raises(jt.ConfigError, match="setup_devices"):
        jt.make_mesh(5)


SNIPPET = """
import jaxtrain as jt, jax
try:
    devs = jt.setup_devices({n})
    print("OK", len(devs), len(jax.devices()))
except jt.ConfigError as e:
    print("ERR", e)
"""


def test_fresh_process_gets_the_asked_count():
    out = run_cli("-c", SNIPPET.format(n=3))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["OK", "3", "3"]


def test_fresh_process_too_many_devices_is_an_error():
    n = max_cpu_devices() + 1
    out = run_cli("-c", SNIPPET.format(n=n))
    assert out.stdout.startswith("ERR"), out.stdout + out.stderr
    assert f"at most {max_cpu_devices()}" in out.stdout


def test_cli_too_many_devices_exits_2_with_one_line():
    out = run_cli("-m", "experiments.lenet", "--devices", "64")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "--devices 64" in lines[0] and f"1..{max_cpu_devices()}" in lines[0]
