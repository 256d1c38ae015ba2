"""oneDNN's convolutions (jaxtrain.kernels.onednn): XLA's values and gradients, the batch kept split under jit,
typed and summed as lax's conv under shard_map, never lowered for a GPU; ResNet-18 and LeNet on 2 devices under
every strategy equal to the independent 1-device reference step with XLA's convolutions; a build that fails (no
compiler, a damaged or unwritable cache) said in one line, never a silent fallback.

The tests marked ``usable`` need the library. CI's ``.ci/run`` runs ``make test``, which installs g++ (``make
onednn``: apt-get where it runs as root) and jaxtrain with all its extras, oneDNN 3.2 from pip among them (cpu-conv)
(``onednn-cpu-gomp``, ``onednn-devel-cpu-gomp``, on x86-64 Linux); so under ``CI=true`` on x86-64 Linux those tests
FAIL where the library is not usable, and skip elsewhere (a machine may lack g++: conv=auto then says so)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from conftest import random_batch, run_cli
import linen_resnet
from reference import Reference, assert_matches, float64_steps
from tolerance import assert_state_reassociated
from test_resnet import to_nnx

import jaxtrain as jt
from jaxtrain import models, settings
from jaxtrain.analysis import diagnostics
from jaxtrain.errors import ConfigError
from jaxtrain.kernels import onednn, onednn_build, onednn_calls
from jaxtrain.models import resnet
from jaxtrain.driver.config import RunConfig
from jaxtrain.driver.report import conv_path

NHWC = ("NHWC", "HWIO", "NHWC")


NOT_INSTALLED = onednn_build._not_installed  # the pre-check a machine's headers decide


@pytest.fixture(autouse=True)
def headers_anywhere(monkeypatch):
    """The tests of builds (a fake compiler, a missing one) mean the build itself: not the pre-check that a
    machine without oneDNN's headers would stop them at (tested on its own below)."""
    monkeypatch.setattr(onednn_build, "_not_installed", lambda: None)


@pytest.fixture(scope="module")
def onednn_library():
    """The library is usable here; else a skip, or under CI on x86-64 Linux (make test installs g++ and oneDNN:
    see the module's docstring) a failure."""
    if not onednn.available():
        if os.environ.get("CI") == "true" and onednn.expected():
            pytest.fail(f"CI installs g++ (make onednn) and oneDNN (pip), yet: {onednn.reason()}")
        pytest.skip(f"oneDNN convolutions not usable: {onednn.reason()}")


usable = pytest.mark.usefixtures("onednn_library")


def _objective(conv, strides, padding):
    def loss(x, w):
        y = conv(x, w, strides, padding, dimension_numbers=NHWC)
        return (jnp.sin(3 * y) + y * y).sum()  # a gradient that differs per output

    return loss


def _loss(conv, strides, padding):
    return jax.jit(jax.value_and_grad(_objective(conv, strides, padding), argnums=(0, 1)))


def _close(got, want, rtol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=rtol * float(np.max(np.abs(w))))


CASES = {  # x shape, w shape, strides, padding: ResNet-18's kinds, LeNet's two, odd sizes
    "3x3": ((4, 14, 14, 16), (3, 3, 16, 32), (1, 1), ((1, 1), (1, 1))),
    "3x3-stride2": ((4, 14, 14, 16), (3, 3, 16, 32), (2, 2), ((1, 1), (1, 1))),
    "1x1-stride2": ((4, 14, 14, 16), (1, 1, 16, 32), (2, 2), ((0, 0), (0, 0))),
    "lenet-conv1": ((4, 28, 28, 1), (3, 3, 1, 20), (1, 1), "VALID"),
    "lenet-conv2": ((4, 13, 13, 20), (5, 5, 20, 50), (1, 1), "VALID"),
    "odd-same": ((3, 9, 11, 8), (3, 3, 8, 8), (1, 2), "SAME"),
}


@usable
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_equal_xla(case):
    xs, ws, strides, padding = CASES[case]
    x = jax.random.normal(jax.random.key(0), xs)
    w = 0.1 * jax.random.normal(jax.random.key(1), ws)
    got = _loss(onednn.conv_general_dilated, strides, padding)
    assert "JaxtrainDnnlConvBwd" in got.lower(x, w).as_text()  # oneDNN's indeed
    _close(got(x, w), _loss(lax.conv_general_dilated, strides, padding)(x, w))


@usable
@pytest.mark.parametrize("what", ["bf16", "dilation", "groups", "nchw"])
def test_what_onednn_does_not_take_is_xla_s(what):
    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 4))
    kw = dict(dimension_numbers=NHWC)
    if what == "bf16":
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    elif what == "dilation":
        kw["rhs_dilation"] = (2, 2)
    elif what == "groups":
        w, kw["feature_group_count"] = jnp.ones((3, 3, 1, 4)), 4
    else:
        x, kw["dimension_numbers"] = jnp.ones((2, 4, 8, 8)), ("NCHW", "HWIO", "NCHW")
    def fn(conv):
        return jax.jit(lambda x, w: conv(x, w, (1, 1), "SAME", **kw))

    assert "JaxtrainDnnl" not in fn(onednn.conv_general_dilated).lower(x, w).as_text()
    np.testing.assert_array_equal(fn(onednn.conv_general_dilated)(x, w), fn(lax.conv_general_dilated)(x, w))


@usable
def test_a_gpu_program_has_only_xla_convolutions():
    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 8))
    grads = jax.jit(jax.grad(lambda x, w: onednn.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC)
                             .sum(), argnums=(0, 1)))
    cuda = grads.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "JaxtrainDnnl" not in cuda and "convolution" in cuda
    assert "JaxtrainDnnl" in grads.lower(x, w).as_text()


def _mesh():
    return jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])


@usable
def test_jit_keeps_the_batch_split_and_sums_the_weight_gradient():
    """Under jit each device convolves its half: no all-gather of the batch (XLA's partitioner would gather it
    for a plain custom call), the input gradient stays split, the weight gradient is the whole batch's."""
    xs, ws, strides, padding = CASES["3x3-stride2"]
    mesh = _mesh()
    x = jax.device_put(jax.random.normal(jax.random.key(0), xs), NamedSharding(mesh, P("data")))
    w = jax.device_put(0.1 * jax.random.normal(jax.random.key(1), ws), NamedSharding(mesh, P()))
    step = _loss(onednn.conv_general_dilated, strides, padding)
    assert "all-gather" not in step.lower(x, w).compile().as_text()
    got = step(x, w)
    assert got[1][0].sharding.spec[0] == "data"
    _close(got, _loss(lax.conv_general_dilated, strides, padding)(jax.device_get(x), jax.device_get(w)))


@usable
@pytest.mark.parametrize("weights", ["invariant", "varying"])
def test_shard_map_types_and_sums_as_lax_does(weights):
    """Inside shard_map the result is varying and the weight gradient summed over the devices exactly when JAX's
    autodiff of lax's conv would sum it (weights invariant), and not when the weights already vary."""
    xs, ws, strides, padding = CASES["3x3"]
    mesh = _mesh()
    x, w = jax.random.normal(jax.random.key(0), xs), 0.1 * jax.random.normal(jax.random.key(1), ws)

    def run(conv):
        def body(x, w):
            w = lax.pcast(w, ("data",), to="varying") if weights == "varying" else w
            return lax.psum(_objective(conv, strides, padding)(x, w), "data")

        whole = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
        return jax.jit(jax.value_and_grad(whole, argnums=(0, 1)))(x, w)

    _close(run(onednn.conv_general_dilated), run(lax.conv_general_dilated))


@pytest.fixture(scope="module")
def variables():
    return to_nnx(*linen_resnet.init_variables(jax.random.key(0), linen_resnet.ResNet18()))


RESNET_BATCH = random_batch(8, seed=11)


@pytest.fixture(scope="module")
def resnet_reference(variables, onednn_library):
    """The independent reference's step with oneDNN's convolutions, its metrics, and the float64 step (XLA's
    convolutions: the same function): computed once for every strategy's case."""
    ref = Reference(resnet.adapter(conv=onednn.conv_general_dilated).loss_fn, optax.sgd(0.1), *variables)
    want = [ref.step(RESNET_BATCH)]
    exact = float64_steps(resnet.adapter().loss_fn, optax.sgd(0.1), variables[0], [RESNET_BATCH],
                          model_state=variables[1])
    return jax.device_get((ref.params, ref.opt_state, ref.model_state)), want, exact


@usable
@pytest.mark.parametrize("strategy,sharding", [*((s, "replicated") for s in jt.STRATEGIES), ("jit", "fsdp"),
                                               ("shard_map", "fsdp")])
def test_resnet18_on_two_devices_equals_the_reference(variables, resnet_reference, strategy, sharding):
    """Held to float64 (XLA's convolutions: the same function) no further than the policy allows a run that is
    1 + MARGIN times as wrong as the independent reference with oneDNN's convolutions on one device: oneDNN's fp32
    weight gradients are themselves ~1% of a leaf's move from float64 here (XLA's 0.01%: docs/testing.md), so
    the fp32 evaluation held to the reference is the one with the same kernels."""
    fast = resnet.adapter(conv=onednn.conv_general_dilated).loss_fn
    trainer = jt.make_train_step(fast, optax.sgd(0.1), mesh=2, strategy=strategy, param_sharding=sharding)
    state, metrics = jax.device_get(trainer(trainer.init(*variables), RESNET_BATCH))
    (params, opt_state, model_state), want, exact = resnet_reference
    theirs = state.replace(params=params, opt_state=opt_state, model_state=model_state)
    assert_state_reassociated(state, [metrics], jax.device_get(theirs), want, exact)


@usable
@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_lenet_on_two_devices_equals_the_reference_with_xla_convolutions(strategy):
    fast, plain = models.get("lenet", conv="onednn"), models.get("lenet", conv="xla")
    assert (fast.conv, plain.conv) == ("onednn", "xla")
    batches = [random_batch(16, seed=s) for s in range(3)]
    params, _ = plain.init(jax.random.key(0))
    trainer = jt.make_train_step(fast.loss_fn, optax.sgd(0.2), mesh=2, strategy=strategy)
    state, history = trainer.init(params), []
    for batch in batches:
        state, metrics = trainer(state, batch)
        history.append(metrics)
    assert_matches(state, history, plain.loss_fn, optax.sgd(0.2), params, batches)


def _unusable(monkeypatch, expected: bool):
    """This process's library: not usable (no compiler), on a machine where oneDNN was ``expected`` or not."""
    why = onednn_build.Unusable("no C++ compiler found (g++)", "install g++ (make onednn)")
    monkeypatch.setattr(onednn, "_library", lambda: why)
    monkeypatch.setattr(onednn, "expected", lambda: expected)
    onednn._say_fallback.cache_clear()


def test_choose_names_the_convolution_and_refuses_what_is_unusable(monkeypatch, capsys, command_line):
    assert onednn.choose("xla") == ("xla", lax.conv_general_dilated)
    with pytest.raises(ConfigError, match="unknown conv 'cudnn'"):
        onednn.choose("cudnn")
    _unusable(monkeypatch, expected=True)
    assert onednn.choose("auto")[0] == "xla" and onednn.choose("auto")[0] == "xla"
    with pytest.raises(ConfigError, match="--conv onednn: no C\\+\\+ compiler found.*--conv xla"):
        models.get("resnet18", conv="onednn")
    said = capsys.readouterr().err.splitlines()  # auto fell back on x86-64 Linux: one line, why and the fix
    assert said == [("warning: oneDNN's convolutions are not usable (no C++ compiler found (g++): install g++ (make "
                     "onednn)); XLA's run instead (slower for ResNet-18 and LeNet on CPUs)")], said


def test_auto_says_nothing_where_onednn_was_not_expected_but_the_run_says_why(monkeypatch, capsys):
    _unusable(monkeypatch, expected=False)
    assert onednn.choose("auto")[0] == "xla" and capsys.readouterr().err == ""
    assert conv_path(RunConfig(), models.get("lenet"), "cpu") == "xla (no C++ compiler found (g++); not x86-64 Linux)"


def test_the_run_names_its_convolutions_and_why(monkeypatch):
    """The run's first line and summary.json say this (report.conv_path)."""
    lenet = models.get("lenet", conv="xla")
    assert conv_path(RunConfig(conv="xla"), lenet, "cpu") == "xla (conv=xla)"
    assert conv_path(RunConfig(), lenet, "gpu") == "xla (GPU)"
    assert conv_path(RunConfig(quantize="int8"), models.get("lenet", quantize="int8"), "cpu").startswith(
        "xla (quantize=int8")
    assert conv_path(RunConfig(model="vit"), models.get("vit", conv="xla"), "cpu") == "none (vit has no convolutions)"
    _unusable(monkeypatch, expected=True)
    assert conv_path(RunConfig(), models.get("lenet"), "cpu") == "xla (no C++ compiler found (g++))"


@usable
def test_the_run_names_onednn_and_its_threads(use_settings):
    use_settings(onednn_threads=1)
    assert conv_path(RunConfig(), models.get("lenet"), "cpu") == "onednn (1 thread)"
    # a new user's finding: bf16 runs none of oneDNN's (f32) convolutions, and the run said "onednn"
    for conv in ("auto", "onednn"):
        assert conv_path(RunConfig(conv=conv, precision="bf16"), models.get("lenet", conv=conv), "cpu") == (
            "xla (precision=bf16: oneDNN's convolutions are fp32's)")


CHAIN = """
import jax, jax.numpy as jnp
from jaxtrain.kernels import onednn
name = onednn.choose("auto")[0]
x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 8))
conv = lambda x, w: onednn.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
text = jax.jit(conv).lower(x, w).as_text()
print(name, onednn.available(), "JaxtrainDnnl" in text, "convolution" in text)
"""


def test_a_failed_build_falls_back_to_xla_saying_why_and_the_build_command_fails(tmp_path):
    """The real chain, in a fresh process and cache: no compiler -> not available -> conv=auto and
    conv_general_dilated take XLA's convolution, with one warning line (on x86-64 Linux); the build command
    exits 1 with the reason in one line."""
    env = {"CXX": "/nonexistent", "JAXTRAIN_ONEDNN_CACHE": str(tmp_path / "cache")}
    out = run_cli("-c", CHAIN, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["xla", "False", "False", "True"], out.stdout
    warnings = [line for line in out.stderr.splitlines() if "oneDNN" in line]
    if onednn.expected():
        # a log warning: Python shows it as it is where nobody configured logging
        assert warnings == [("oneDNN's convolutions are not usable (no C++ compiler found (/nonexistent): "
                             "install g++ (make onednn; Debian: apt-get install g++)); XLA's run instead (slower for "
                             "ResNet-18 and LeNet on CPUs)")], out.stderr
    else:
        assert warnings == [], out.stderr
    built = run_cli("-m", "jaxtrain.kernels.onednn", env=env)
    assert built.returncode == 1 and built.stdout == "", (built.stdout, built.stderr)
    assert built.stderr.splitlines() == [("oneDNN convolutions: not usable: no C++ compiler found (/nonexistent): "
                                          "install g++ (make onednn; Debian: apt-get install g++)")], built.stderr


def test_a_machine_without_a_compiler_is_told_what_to_install(monkeypatch, use_settings, tmp_path):
    use_settings(onednn_cache=tmp_path)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(onednn_build.Unusable, match="no C\\+\\+ compiler found.*install g\\+\\+ \\(make onednn"):
        onednn.build()
    monkeypatch.setenv("CXX", "false")  # a compiler that fails: no library left behind
    with pytest.raises(onednn_build.Unusable, match="build failed: .*false exited 1: install g\\+\\+"):
        onednn.build()
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".build")] == []


def test_a_machine_without_onednn_is_told_its_extra(monkeypatch, use_settings, tmp_path):
    """Issue 68: oneDNN is the cpu-conv extra, not the core: a build that cannot find its header names it."""
    use_settings(onednn_cache=tmp_path)
    compiler = tmp_path / "no-dnnl-g++"
    compiler.write_text("#!/bin/sh\necho 'fatal error: oneapi/dnnl/dnnl.hpp: No such file or directory' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    with pytest.raises(onednn_build.Unusable, match=r"dnnl\.hpp.*: pip install 'jaxtrain\[cpu-conv\]'"):
        onednn.build()


def test_a_machine_without_onednn_installed_is_told_before_any_build(monkeypatch, use_settings, tmp_path):
    """The core wheel without the cpu-conv extra: no header anywhere, so no compiler is run to find that out."""
    use_settings(onednn_cache=tmp_path / "cache")
    compiler, runs = _fake_compiler(tmp_path, "a library")
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(onednn_build, "_not_installed", NOT_INSTALLED)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(onednn_build, "SYSTEM_INCLUDES", (str(tmp_path / "usr"),))
    monkeypatch.delenv("CPATH", raising=False)
    monkeypatch.delenv("CPLUS_INCLUDE_PATH", raising=False)
    with pytest.raises(onednn_build.Unusable) as e:
        onednn.build()
    assert e.value.cause == "oneDNN is not installed" and "pip install 'jaxtrain[cpu-conv]'" in e.value.fix
    assert not (tmp_path / "runs").exists()
    (tmp_path / "usr" / "oneapi" / "dnnl").mkdir(parents=True)  # where a system install puts it: a build is tried
    (tmp_path / "usr" / "oneapi" / "dnnl" / "dnnl.hpp").touch()
    onednn.build()
    assert runs() == 1


def _fake_compiler(tmp_path, output: str):
    """A "compiler" that writes ``output`` where -o says and counts its runs in ``runs``: fast, and no g++."""
    script = tmp_path / "fake-g++"
    script.write_text(f"#!/bin/sh\necho run >> {tmp_path}/runs\nwhile [ $# -gt 1 ]; do [ \"$1\" = -o ] && "
                      f"out=\"$2\"; shift; done\nprintf '{output}' > \"$out\"\n")
    script.chmod(0o755)
    return script, lambda: len((tmp_path / "runs").read_text().split())


def test_a_damaged_cached_library_is_rebuilt_once_saying_so(monkeypatch, use_settings, tmp_path, capsys, command_line):
    cache = tmp_path / "cache"
    compiler, runs = _fake_compiler(tmp_path, "not a library")
    use_settings(onednn_cache=cache)
    monkeypatch.setenv("CXX", str(compiler))
    lib = onednn.build()
    assert onednn_build.intact(lib) and onednn.build() == lib and runs() == 1  # built once, then the cache's
    lib.write_bytes(lib.read_bytes()[:5])  # damaged: no longer its digest
    assert onednn.build() == lib and onednn_build.intact(lib) and runs() == 2
    assert capsys.readouterr().err.splitlines() == [
        f"warning: the cached {lib} does not match its digest ({lib.stem}.sha256): rebuilding it"]
    with pytest.raises(onednn_build.Unusable, match="the library does not load .*delete .* and run python -m"):
        onednn_build.load()  # its digest's, but not a library: rebuilt once, then refused
    assert runs() == 3
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(f"warning: the cached {lib} does not load (") and said[0].endswith(
        "): rebuilding it"), said


def test_an_unwritable_cache_builds_in_a_private_directory_saying_so(monkeypatch, use_settings, tmp_path, capsys,
                                                                    command_line):
    """A cache under a file: as unwritable as a read-only mount (chmod does not stop root)."""
    (tmp_path / "file").write_text("")
    compiler, runs = _fake_compiler(tmp_path, "library")
    use_settings(onednn_cache=tmp_path / "file" / "cache")
    monkeypatch.setenv("CXX", str(compiler))
    lib = onednn.build()
    assert onednn_build.intact(lib) and lib.parent.name.startswith("jaxtrain-onednn-") and runs() == 1
    said = capsys.readouterr().err.splitlines()
    assert said == [(f"warning: cannot write the oneDNN cache {tmp_path}/file/cache (Not a directory): building "
                     f"oneDNN's convolutions in {lib.parent} for this process only (a build each start); set "
                     "$JAXTRAIN_ONEDNN_CACHE to a writable directory")], said


@usable
@pytest.mark.parametrize("case", ["3x3-stride2", "odd-same", "lenet-conv2"])
def test_flops_are_counted_as_xla_counts_its_convolutions(case):
    """XLA's cost analysis sees nothing in a custom call: ``hlo_flops`` adds oneDNN's, as XLA counts its own."""
    xs, ws, strides, padding = CASES[case]
    x, w = jnp.ones(xs), jnp.ones(ws)
    def count(conv):
        return diagnostics.program_flops(_loss(conv, strides, padding).lower(x, w).compile())

    assert count(onednn.conv_general_dilated) == pytest.approx(count(lax.conv_general_dilated), rel=1e-3)


@usable
def test_the_blocked_layouts_and_the_saved_input_equal_xla_too(use_settings):
    """``JAXTRAIN_ONEDNN_BLOCKED=1`` (an attribute of each call) takes oneDNN's blocked layouts, where the
    forward saves x in the backward-weights layout: that path equals XLA's too."""
    use_settings(onednn_blocked=True)
    xs, ws, strides, padding = (5, 10, 10, 32), (3, 3, 32, 48), (1, 1), ((1, 1), (1, 1))
    assert onednn._saved_floats(xs, ws, (strides, padding)) > 0  # the saved path is taken
    x = jax.random.normal(jax.random.key(0), xs)
    w = 0.1 * jax.random.normal(jax.random.key(1), ws)
    fast = _loss(onednn.conv_general_dilated, strides, padding)
    assert "JaxtrainDnnlConvFwdSave" in fast.lower(x, w).as_text()
    _close(fast(x, w), _loss(lax.conv_general_dilated, strides, padding)(x, w))


def test_threads_are_the_cores_over_the_devices_or_what_the_environment_says(use_settings, capsys, command_line):
    """$JAXTRAIN_ONEDNN_THREADS: 1 to the cores this process may run on; past the cores over the devices at once
    (here 4 devices), one warning line; anything else a ConfigError."""
    cores, fair = settings.cores(), max(1, settings.cores() // jax.local_device_count())
    use_settings(onednn_threads=None)
    assert onednn_calls.threads() == fair
    use_settings(onednn_threads=1)
    assert onednn_calls.threads() == 1 and capsys.readouterr().err == ""
    for bad in ("two", "0", "99999999999", str(cores + 1)):
        with pytest.raises(ConfigError, match=f"JAXTRAIN_ONEDNN_THREADS={bad}: must be a whole number from 1 to "
                                              f"{cores} \\(the cores this process may run on\\)"):
            settings.read({"JAXTRAIN_ONEDNN_THREADS": bad})
    if cores > fair:
        onednn_calls._warn_oversubscribed.cache_clear()
        use_settings(onednn_threads=cores)
        assert onednn_calls.threads() == cores and onednn_calls.threads() == cores
        said = capsys.readouterr().err.splitlines()
        devices = jax.local_device_count()
        assert said == [(f"warning: JAXTRAIN_ONEDNN_THREADS={cores} x {devices} device(s) at once = "
                         f"{cores * devices} threads on {cores} cores: the calls oversubscribe the cores (slower); "
                         f"unset it for {fair} per call")], said


@usable
def test_a_bad_thread_count_is_refused_when_the_model_is_made(monkeypatch):
    """Before any data is read or step traced (a run's validate makes the model first): the settings are read
    from the environment anew here, as a process's first read would."""
    monkeypatch.setenv("JAXTRAIN_ONEDNN_THREADS", "99999999999")
    monkeypatch.setattr(settings, "_current", None)
    with pytest.raises(ConfigError, match="JAXTRAIN_ONEDNN_THREADS=99999999999: must be a whole number from 1"):
        models.get("lenet")
