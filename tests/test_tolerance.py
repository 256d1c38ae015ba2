"""The tolerance policy itself (tests/tolerance.py): what it lets through and what it must still fail.

The run is test_sharding's (LeNet, SGD + momentum at lr 0.2, 3 steps of 64):
``want`` is the independent reference in fp32, ``exact`` the same steps in
float64, and ``got`` is ``want`` with one fault planted.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import random_batch
from reference import Reference, float64_steps
from tolerance import KINK, assert_reassociated

from jaxtrain.models import lenet

BATCHES = [random_batch(64, seed=s) for s in range(3)]


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
    assert_reassociated(got, want, exact.params, "params", exact.start_params, KINK)


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
def test_a_leaf_off_by_part_of_its_own_move_fails(runs, leaf, fault, share):
    """The smallest-moving leaves (dense1) move 11% of the largest (conv1's bias): their faults fail too."""
    exact, states = runs
    want = states[-1]
    start = np.asarray(exact.start_params[leaf[0]][leaf[1]], np.float32)
    got = planted(want, leaf, lambda x: x + share * (x - start))
    with pytest.raises(AssertionError, match=f"params\\['{leaf[0]}'\\]\\['{leaf[1]}'\\]"):
        check(got, want, exact)


def test_a_skipped_last_update_fails(runs):
    exact, states = runs
    with pytest.raises(AssertionError, match="beyond the policy's bound"):
        check(states[-2], states[-1], exact)
