"""Device set-up and mesh: counts, errors, and the CLI's one-line failures."""

import jax
import pytest
from conftest import run_cli

import jaxtrain as jt
from jaxtrain import settings
from jaxtrain.parallel import host_memory
from jaxtrain.parallel.devices import max_cpu_devices


def test_setup_devices_matches_running_backend():
    assert len(jt.setup_devices(4)) == 4  # conftest started JAX with 4
    assert len(jt.setup_devices()) == 4


def test_setup_devices_after_start_with_fewer_says_what_to_do():
    with pytest.raises(jt.ConfigError, match=r"already started with 4 CPU devices.*in a notebook: restart the "
                                             r"kernel.*JAX_NUM_CPU_DEVICES=8"):
        jt.setup_devices(8)


def test_setup_devices_after_start_with_more_takes_the_first_saying_so(capsys):
    """A notebook's d2l lesson: 2 devices set up, then a 1-device run beside a 2-device one, as on GPUs. Called
    alone, it says so itself (jaxtrain.io.console.shown)."""
    assert jt.setup_devices(2) == jax.devices()[:2]
    err = capsys.readouterr().err
    assert err.startswith("warning: using the first 2 of the 4 CPU devices JAX started with"), err


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


XLA_SNIPPET = """
import os, jaxtrain as jt, jax, jax.numpy as jnp
jt.setup_devices(1)
conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
hlo = jax.jit(conv).lower(jnp.ones((8, 13, 13, 20)), jnp.ones((5, 5, 20, 50))).compile().as_text()
print(os.environ.get("XLA_FLAGS", ""), "|", "__ynn_fusion" in hlo)
"""


@pytest.mark.parametrize(("env", "flags", "ynn"), [
    ({}, "--xla_cpu_experimental_ynn_fusion_type=reduce", False),  # jaxtrain's CPU default: no YNN convs
    ({"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=individual_convolution"},
     "--xla_cpu_experimental_ynn_fusion_type=individual_convolution", True),  # the user's flag wins
    ({"JAXTRAIN_XLA_DEFAULTS": "1"}, "", True),  # opt out: XLA's defaults
])
def test_cpu_xla_flags_are_set_before_jax_starts_unless_the_user_chose(env, flags, ynn):
    out = run_cli("-c", XLA_SNIPPET, env={"XLA_FLAGS": "", **env})
    assert out.returncode == 0, out.stderr
    got_flags, got_ynn = out.stdout.rsplit("|", 1)
    assert got_flags.strip() == flags and got_ynn.strip() == str(ynn)


GPU_SNIPPET = """
import os, sys, jaxtrain as jt
from jaxtrain.parallel import devices
if sys.argv[1] == "gpu":
    devices._platform_hint = lambda: "cuda"  # as where JAX starts on a GPU (this one still starts on the CPU)
jt.setup_devices(1)
print(os.environ.get("XLA_FLAGS", ""))
"""
CB = "--xla_gpu_enable_command_buffer="


@pytest.mark.parametrize(("platform", "env", "flag"), [
    ("gpu", {}, None),  # XLA's own command buffers until a GPU has measured another choice
    ("gpu", {"JAXTRAIN_COMMAND_BUFFERS": "off"}, CB),
    ("gpu", {"JAXTRAIN_COMMAND_BUFFERS": "loops"}, CB + "+WHILE,+CONDITIONAL"),
    ("gpu", {"JAXTRAIN_COMMAND_BUFFERS": "loops", "XLA_FLAGS": CB + "FUSION"}, CB + "FUSION"),  # the user's wins
    ("cpu", {"JAXTRAIN_COMMAND_BUFFERS": "loops"}, None),  # a GPU's flag, set on GPUs only
])
def test_command_buffers_are_set_where_jax_starts_on_a_gpu(platform, env, flag):
    out = run_cli("-c", GPU_SNIPPET, platform, env={"XLA_FLAGS": "", **env})
    assert out.returncode == 0, out.stderr
    got = [f for f in out.stdout.split() if f.startswith(CB)]
    assert got == ([flag] if flag else []), out.stdout


MALLOC_SNIPPET = """
import ctypes, resource, jaxtrain as jt
from jaxtrain.parallel import host_memory
jt.setup_devices(1)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def touch():  # 64 MiB malloc'ed, written, freed (as XLA:CPU does a step's temporaries; numpy would ask for huge pages)
    block = libc.malloc(64 * 2**20)
    ctypes.memset(block, 1, 64 * 2**20)
    libc.free(block)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(host_memory.applied(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not host_memory.glibc(), reason="the settings are glibc's malloc's")
@pytest.mark.parametrize(("env", "kept"), [({}, True), ({"JAXTRAIN_MALLOC": "default"}, False)])
def test_cpu_runs_keep_freed_host_memory_unless_told_not_to(env, kept):
    """A block freed and allocated again is not page-faulted in again (16,384 4-KiB pages with glibc's defaults)."""
    if not kept and _huge_pages_always():
        pytest.skip("transparent huge pages are always on here: glibc's mapped blocks fault in 2 MiB at a time")
    out = run_cli("-c", MALLOC_SNIPPET, env={"JAXTRAIN_MALLOC": None, **env})
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    assert applied == str(kept)
    assert int(faults) < 1000 if kept else int(faults) > 8000, faults


TOP_SNIPPET = """
import ctypes, resource, sys
from jaxtrain.parallel import host_memory
if sys.argv[1] == "mallopt":
    assert host_memory.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 9 * 2**28  # 2.25 GiB: freed, the heap's free top is over 2 GiB
for time in range(2):
    if time:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    if not block:
        sys.exit(f"malloc could not give {size} bytes: the test needs 2.25 GiB of memory")
    ctypes.memset(block, 1, size)
    libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not host_memory.glibc(), reason="the settings are glibc's malloc's")
@pytest.mark.parametrize("how", ["mallopt", "environment"])
def test_a_freed_block_over_2_gib_stays_in_the_process(how):
    """The heap's free top is never trimmed: a 2.25 GiB block freed and allocated again is not page-faulted in
    again, under ``keep_freed_memory``'s mallopt and under the variables PyTorch's worker is given
    (``ENV_SETTINGS``). With a trim threshold of 2 GiB (the largest positive C int, until 2026-11-30) it was:
    ~590,000 faults (in 4 KiB pages; ~1,150 in 2 MiB ones where transparent huge pages are always on). One
    thread, nothing allocated between: the block is the heap's top."""
    env = {"JAXTRAIN_MALLOC": None} if how == "mallopt" else {"JAXTRAIN_MALLOC": "default", **host_memory.ENV_SETTINGS}
    out = run_cli("-c", TOP_SNIPPET, how, env=env)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 100, out.stdout


@pytest.mark.parametrize("value", ["off", "0", "none", "defaults", "glibc"])
def test_an_unknown_malloc_setting_is_refused(monkeypatch, value):
    """Only "default" opts out: a misspelt opt-out must not keep jaxtrain's malloc settings silently (each
    setting read anew from the environment, as a process's first read is)."""
    monkeypatch.setenv("JAXTRAIN_MALLOC", value)
    monkeypatch.setattr(settings, "_current", None)
    with pytest.raises(jt.ConfigError, match=f"^JAXTRAIN_MALLOC={value}: unknown value: set "
                                             "JAXTRAIN_MALLOC=default to keep glibc's malloc settings, or unset it"):
        host_memory.wanted()
    for fine, kept in (("default", False), ("DEFAULT", False), ("", host_memory.glibc())):
        monkeypatch.setenv("JAXTRAIN_MALLOC", fine)
        monkeypatch.setattr(settings, "_current", None)
        assert host_memory.wanted() is kept


def test_a_command_buffer_mode_under_an_untested_jaxlib_is_left_out_saying_so(monkeypatch, caplog):
    from jaxtrain import settings
    from jaxtrain.core import compat
    from jaxtrain.parallel import devices

    monkeypatch.setattr(devices, "_platform_hint", lambda: "cuda")
    monkeypatch.setattr(compat, "installed_version", lambda dist: (0, 13, 0))
    monkeypatch.setattr(compat, "installed_version_text", lambda dist: "0.13.0")
    with settings.override(command_buffers="loops"), caplog.at_level("WARNING"):
        assert devices._gpu_flags() == ()
    assert [r.getMessage() for r in caplog.records] == [
        "JAXTRAIN_COMMAND_BUFFERS=loops not set: its XLA flag's form is not known to parse in jaxlib 0.13.0 "
        "(tested: 0.10.2, 0.11.2 and 0.12.0.1); no flag is added for it"]
    with settings.override(command_buffers="xla"), caplog.at_level("WARNING"):
        caplog.clear()
        assert devices._gpu_flags() == () and not caplog.records  # nothing asked for, nothing said
