"""Version differences and GPU readiness that can be checked on a CPU host."""

import warnings

import jax
import optax
import pytest
from conftest import random_batch

import jaxtrain as jt
from jaxtrain.core import compat
from jaxtrain.models import lenet

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type=reduce"


@pytest.mark.parametrize(("text", "parsed"), [("0.12.0.1", (0, 12, 0)), ("0.10.2", (0, 10, 2)),
                                               ("0.11.0rc1", (0, 11, 0)), ("0.12.1+cuda13", (0, 12, 1))])
def test_version_tuple(text, parsed):
    assert compat.version_tuple(text) == parsed


@pytest.mark.parametrize(("jaxlib", "isa", "flags"), [
    ((0, 10, 2), "AVX-512", (YNN_FLAG,)), ((0, 11, 2), "AVX2", (YNN_FLAG,)), ((0, 12, 0), "AVX-512", (YNN_FLAG,)),
    ((0, 10, 1), "AVX-512", ()),  # older than tested: XLA's defaults, never a flag that might not exist
    ((0, 13, 0), "AVX2", ()),  # newer than tested: the same
    ((0, 12, 0), "older than AVX2", ()),  # a CPU kind the flag was never measured on: XLA's defaults
    ((0, 10, 2), "", ()),  # not x86 (e.g. ARM): the same
])
def test_cpu_xla_flags_only_for_jaxlibs_known_to_have_them_on_cpus_measured(jaxlib, isa, flags):
    assert compat.cpu_xla_flags(jaxlib, isa) == flags


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


@pytest.mark.parametrize(("flags", "xla_flags", "isa"), [
    ("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni", "", "AVX-512"),
    ("fpu sse4_2 avx avx2 fma avx512f", "--xla_cpu_max_isa=AVX2", "AVX2"),  # XLA's cap: the code built here
    ("fpu sse4_2 avx avx2 fma avx512f", "--xla_cpu_max_isa=avx512_vnni", "AVX-512"),
    ("fpu sse4_2 avx avx2 fma", "", "AVX2"),  # an AVX2-only EPYC: no avx512f
    ("fpu sse4_2 avx avx2 fma", "--xla_cpu_max_isa=AVX512", "AVX2"),  # a cap never raises it
    ("fpu sse4_2 avx", "", "older than AVX2"),
    ("fp asimd evtstrm", "", ""),  # not x86 (an ARM /proc/cpuinfo has "Features", no x86 flags)
])
def test_the_cpu_isa_is_read_from_the_flags_and_capped_by_xla(flags, xla_flags, isa):
    assert compat.cpu_isa(f"processor\t: 0\nflags\t\t: {flags}\n", xla_flags) == isa


@pytest.mark.parametrize(("jaxlib", "ynn"), [((0, 10, 2), True), ((0, 12, 0), True), ((0, 10, 1), False),
                                             ((0, 13, 0), False)])
def test_int8_programs_get_their_own_options_only_for_tested_jaxlibs(jaxlib, ynn):
    options = compat.int8_compiler_options(jaxlib)
    assert ("INDIVIDUAL_CONVOLUTION" in options.get("xla_cpu_experimental_ynn_fusion_type", "")) == ynn


@pytest.mark.parametrize(("mode", "jaxlib", "flags"), [
    ("xla", (0, 12, 0), ()),  # XLA's own choice: nothing set
    ("off", (0, 10, 2), ("--xla_gpu_enable_command_buffer=",)),
    ("loops", (0, 11, 2), ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",)),
    ("loops", (0, 13, 0), ()),  # newer than tested: no flag whose form might not parse
    ("off", (0, 10, 1), ()),
])
def test_command_buffer_flags_only_for_jaxlibs_known_to_parse_them(mode, jaxlib, flags):
    assert compat.gpu_xla_flags(mode, jaxlib) == flags
    assert compat.command_buffers_untested(mode, jaxlib) == (mode != "xla" and not flags)


@pytest.mark.parametrize("mode", ["off", "loops"])
def test_the_installed_jaxlib_starts_under_each_command_buffer_flag(mode):
    """An XLA flag whose value does not parse aborts the process at start-up: each mode's flag, given to this
    jaxlib (a CPU backend parses the GPU flags too), starts JAX; a bad value does not (the check can fail)."""
    import os
    import subprocess
    import sys

    def starts(flags):
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                              env={**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}).returncode

    assert compat.gpu_xla_flags(mode), "the installed jaxlib is in the tested range"
    assert starts(compat.gpu_xla_flags(mode)) == 0
    assert starts(("--xla_gpu_enable_command_buffer=+LOOPS",)) != 0


@pytest.mark.parametrize(("xla_flags", "said"), [
    ("", "XLA's own"), ("--xla_gpu_enable_command_buffer= --xla_foo=1", "off"),
    ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", "XLA's own + WHILE, CONDITIONAL"),  # loops
    ("--xla_gpu_enable_command_buffer=-FUSION", "XLA's own - FUSION"),
    # read in order, as XLA does: a list replaces the types, +/- change those so far
    ("--xla_gpu_enable_command_buffer=FUSION --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
     "FUSION, WHILE, CONDITIONAL"),
    ("--xla_gpu_enable_command_buffer= --xla_gpu_enable_command_buffer=+WHILE", "WHILE"),
    ("--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_enable_command_buffer=", "off"),
    ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS --xla_gpu_enable_command_buffer=-cublas", "FUSION"),
])
def test_the_first_line_says_what_the_flags_leave_command_buffers(xla_flags, said):
    assert compat.command_buffers_said(xla_flags) == said
