"""The tolerance policy itself (tests/tolerance.py): what it lets through and what it must still fail.

The run is test_sharding's (LeNet, SGD + momentum at lr 0.2, 3 steps of 64):
``want`` is the independent reference in fp32, ``exact`` the same steps in
float64, and ``got`` is ``want`` with one fault planted.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from conftest import random_batch
from reference import Reference, float64_steps
from tolerance import KINK, assert_reassociated

from jaxtrain.models import lenet

BATCHES = [random_batch(64, seed=s) for s in range(3)]


@pytest.fixture
def unlogged(monkeypatch):
    """A test that plants faults: tools/tolerance-sweep's log ($JAXTRAIN_TOLERANCE_LOG) is of legitimate
    variations only."""
    monkeypatch.delenv("JAXTRAIN_TOLERANCE_LOG", raising=False)


def tx():
    return optax.sgd(0.2, momentum=0.9)


@pytest.fixture(scope="module")
def runs():
    params = lenet.init_params(jax.random.key(0), scale=0.1)
    exact = float64_steps(lenet.loss_fn, tx(), params, BATCHES)
    ref = Reference(lenet.loss_fn, tx(), params)
    states = [jax.device_get(ref.params)]
    for batch in BATCHES:
        ref.step(batch)
        states.append(jax.device_get(ref.params))
    return exact, states


def planted(params, path, change):
    """``params`` with ``change(leaf)`` at ``path`` (layer, name)."""
    out = jax.tree.map(np.array, params)
    out[path[0]][path[1]] = change(out[path[0]][path[1]])
    return out


def check(got, want, exact):
    assert_reassociated(got, want, exact.params, "params", exact.start_params)


def test_the_fp32_reference_and_a_flipped_kink_pass(runs):
    """The flip seen under jax 0.12's remat on an AMD EPYC with AVX2: conv1's bias, channel 13, 4.17e-6 off."""
    exact, states = runs
    want = states[-1]
    check(want, want, exact)

    def flip(b):
        b[13] += 4.17e-6
        return b

    check(planted(want, ("conv1", "b"), flip), want, exact)


@pytest.mark.parametrize("leaf", [("dense1", "w"), ("dense1", "b"), ("conv2", "w"), ("conv1", "b")])
@pytest.mark.parametrize("fault, share", [("a lost device's share", 0.25), ("a gradient 2% off", 0.02)])
def test_a_leaf_off_by_part_of_its_own_move_fails(runs, leaf, fault, share, unlogged):
    """The smallest-moving leaves (dense1) move 11% of the largest (conv1's bias): their faults fail too."""
    exact, states = runs
    want = states[-1]
    start = np.asarray(exact.start_params[leaf[0]][leaf[1]], np.float32)
    got = planted(want, leaf, lambda x: x + share * (x - start))
    with pytest.raises(AssertionError, match=f"params\\['{leaf[0]}'\\]\\['{leaf[1]}'\\]"):
        check(got, want, exact)


def test_a_skipped_last_update_fails(runs, unlogged):
    exact, states = runs
    with pytest.raises(AssertionError, match="beyond the policy's bound"):
        check(states[-2], states[-1], exact)


# ResNet-18 (test_resnet's one SGD step of d2l's model at lr 0.1 on 8 images), params and BatchNorm statistics.
# Each leaf is held to its own move, so a fault on the leaves that move least fails as surely as on the stem.
RESNET_FAULTS = {  # (fault, what it makes of the leaf's update)
    "a skipped update": lambda update, half: 0 * update,
    "a doubled gradient": lambda update, half: 2 * update,
    "a gradient 2% off": lambda update, half: 1.02 * update,
    "a lost device's share": lambda update, half: half / 2,  # the other device's half of the batch added as 0
}


def recording_relus(decisions: list):
    """``nnx.relu``, appending each call's decisions (``x > 0``) to ``decisions`` as the compiled step runs."""
    relu = nnx.relu

    def recording(x):
        jax.debug.callback(lambda mask: decisions.append(np.asarray(mask)), x > 0, ordered=True)
        return relu(x)
    return recording


def replayed_relus(decisions: list):
    """A ReLU that takes ``decisions`` (one forward pass's, in call order) instead of its input's sign."""
    calls = []

    def replayed(x):
        mask = decisions[len(calls) % len(decisions)]
        calls.append(None)
        assert mask.shape == x.shape, (len(calls), mask.shape, x.shape)
        return jnp.where(mask, x, jnp.zeros_like(x))
    return replayed


def test_the_float64_run_replays_the_fp32_runs_relu_decisions():
    """Recorded from a compiled fp32 function in call order, replayed in float64: a decision the fp32 run took
    the other way is the float64 run's too, in the value and in the gradient."""
    def f(w, x):
        h = nnx.relu(x @ w)
        return jnp.sum(nnx.relu(h @ w.T) ** 2)

    w, x = jnp.eye(3, dtype=jnp.float32), jnp.array([[1.0, -2.0, 3.0]], jnp.float32)
    decisions = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nnx, "relu", recording_relus(decisions))
        jax.jit(jax.grad(f))(w, x)
        jax.effects_barrier()
    assert [d.tolist() for d in decisions] == [[[True, False, True]]] * 2
    decisions[1] = np.array([[True, True, False]])  # the second ReLU taken the other way on two elements

    def masked(w, x):  # f with those decisions written out
        h = (x @ w) * decisions[0]
        return jnp.sum(((h @ w.T) * decisions[1]) ** 2)

    w, x = np.eye(3) + 0.25, np.array([[1.0, -2.0, 3.0]])
    with jax.enable_x64(True):
        want = jax.value_and_grad(masked)(w, x)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(nnx, "relu", replayed_relus(decisions))
            got = jax.value_and_grad(f)(w, x)
    assert got[1].dtype == np.float64
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.fixture(scope="module")
def resnet_runs():
    """(float64 run, the fp32 reference's state, its state from device 0's half of the batch alone) of one step.

    The float64 run takes the fp32 reference's ReLU decisions. An input on its kink that the reference rounds
    the other way (one thread does, on an AMD EPYC with AVX2) would otherwise make the reference itself a flip's
    distance from float64, and MARGIN times that distance covered a 2% fault on the leaves upstream of it (two
    BatchNorm biases). With the same decisions, the reference is off by re-association alone, on any CPU.
    """
    from test_resnet import BATCH, to_nnx
    import linen_resnet
    from jaxtrain.models import resnet

    params, stats = to_nnx(*linen_resnet.init_variables(jax.random.key(0), linen_resnet.ResNet18()))
    decisions, runs = [], []
    for batch in (BATCH, jax.tree.map(lambda x: x[: len(x) // 2], BATCH)):
        with pytest.MonkeyPatch.context() as patch:
            if not decisions:
                patch.setattr(nnx, "relu", recording_relus(decisions))
            ref = Reference(resnet.adapter().loss_fn, optax.sgd(0.1), params, stats)
            ref.step(batch)
            jax.effects_barrier()
        runs.append(jax.device_get((ref.params, ref.model_state)))
    assert len(decisions) == 17, len(decisions)  # ResNet-18's ReLUs: the stem's and two in each of 8 blocks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nnx, "relu", replayed_relus(decisions))
        exact = float64_steps(resnet.adapter().loss_fn, optax.sgd(0.1), params, [BATCH], model_state=stats)
    return exact, *runs


def least_moving(exact, part, pattern):
    """The path of ``part``'s leaf matching ``pattern`` that moved least in the float64 run."""
    start = exact.start_params if part == "params" else exact.start_model_state
    moves = {jax.tree_util.keystr(p): float(np.abs(np.asarray(e) - s).max())
             for (p, e), s in zip(jax.tree_util.tree_flatten_with_path(getattr(exact, part))[0],
                                  jax.tree.leaves(start))}
    return min((m, p) for p, m in moves.items() if re.search(pattern, p))[1]


def with_fault(tree, start, half, path, fault):
    """``tree`` with the leaf at ``path`` (a keystr) updated from ``start`` as ``fault`` makes of its update."""
    def change(p, x, s, h):
        if jax.tree_util.keystr(p) != path:
            return x
        s = np.asarray(s, np.float64)
        return np.asarray(s + RESNET_FAULTS[fault](np.asarray(x, np.float64) - s, np.asarray(h, np.float64) - s),
                          np.float32)
    return jax.tree_util.tree_map_with_path(change, tree, start, half)


@pytest.mark.parametrize("fault", RESNET_FAULTS)
@pytest.mark.parametrize("part, pattern", [("params", r"\['kernel'\]$"), ("params", r"\['scale'\]$"),
                                           ("model_state", r"\['mean'\]$")])
def test_a_fault_on_a_resnet18_leaf_that_moves_least_fails(resnet_runs, part, pattern, fault, unlogged):
    """The least-moving convolution kernel (block 6's shortcut), BatchNorm scale (block 7's bn1) and running mean
    (the stem's), each with a fault a strategy could make. All 12 passed the FLIP policy this one replaced."""
    exact, (params, stats), half = resnet_runs
    path = least_moving(exact, part, pattern)
    start = exact.start_params if part == "params" else exact.start_model_state
    want = params if part == "params" else stats
    got = with_fault(want, start, half[0] if part == "params" else half[1], path, fault)
    with pytest.raises(AssertionError, match=re.escape(f"{part}{path}:")):
        assert_reassociated(got, want, getattr(exact, part), part, start)


@pytest.mark.parametrize("part", ["params", "model_state"])
def test_every_resnet18_leaf_that_moves_is_held_to_under_2_percent_of_its_move(resnet_runs, part, unlogged):
    """A gradient 2% off planted on every leaf at once: every leaf is named but the conv biases before a
    BatchNorm, whose float64 gradient is 0 (their move is rounding: 1e-15 of the largest, the stem's), so the
    policy's resolution on this step is under 2% of each leaf's own move; the fp32 reference passes."""
    exact, (params, stats), half = resnet_runs
    start = exact.start_params if part == "params" else exact.start_model_state
    want = params if part == "params" else stats
    assert_reassociated(want, want, getattr(exact, part), part, start)
    got = jax.tree.map(lambda x, s: np.asarray(s + 1.02 * (np.asarray(x, np.float64) - s), np.float32), want, start)
    paths = jax.tree_util.tree_flatten_with_path(getattr(exact, part))[0]
    moves = {jax.tree_util.keystr(p): float(np.abs(np.asarray(e) - s).max())
             for (p, e), s in zip(paths, jax.tree.leaves(start))}
    with pytest.raises(AssertionError) as failed:
        assert_reassociated(got, want, getattr(exact, part), part, start)
    named = set(re.findall(rf"^{part}(\S+): ", str(failed.value), re.M))
    unmoved = {p for p, m in moves.items() if m < 1e-12 * max(moves.values())}
    assert named == set(moves) - unmoved, sorted(set(moves) - unmoved - named)
    assert all(p.endswith("['bias']") and "bn" not in p for p in unmoved), sorted(unmoved)
    assert len(unmoved) == {"params": 17, "model_state": 0}[part], sorted(unmoved)


def test_a_relu_flipped_in_a_resnet18_step_passes(resnet_runs, monkeypatch):
    """The fp32 reference with one ReLU decision taken the other way: block 6's first ReLU at an input 8.1e-6
    above 0 in float64, the one of six such flips tried that moved a kernel most (3% of its move in a few
    elements; 0.04% along its update). Another CPU's rounding can flip it: the step must still pass."""
    from test_resnet import BATCH, to_nnx
    import linen_resnet
    from jaxtrain.models import resnet

    exact, (params, stats), _ = resnet_runs
    relu, calls = nnx.relu, []

    def flipped(x):  # the 14th ReLU of the forward pass: blocks[6]'s relu1
        calls.append(None)
        if len(calls) != 14:
            return relu(x)
        return x * ((x > 0) ^ jnp.zeros(x.shape, bool).at[1, 0, 2, 368].set(True)).astype(x.dtype)

    monkeypatch.setattr(nnx, "relu", flipped)
    ref = Reference(resnet.adapter().loss_fn, optax.sgd(0.1), *to_nnx(*linen_resnet.init_variables(
        jax.random.key(0), linen_resnet.ResNet18())))
    ref.step(BATCH)
    got = jax.device_get(ref.params)
    assert len(calls) >= 17
    kernel = exact.params["blocks"][6]["conv1"]["kernel"]
    moved = np.abs(kernel - exact.start_params["blocks"][6]["conv1"]["kernel"]).max()
    off = np.abs(got["blocks"][6]["conv1"]["kernel"] - kernel).max()
    assert off > 10 * KINK * moved, off / moved  # a flip the ResNet-18 tests could not tell from a fault before ALONG
    assert_reassociated(got, params, exact.params, "params", exact.start_params)
