"""make_train_step on 1 device equals the independent reference step (tests/reference.py).

The other equivalence tests compare N devices with jaxtrain's 1-device step;
these tie that step to code that shares nothing with jaxtrain's, so a bug on
the shared path (cast, loss scale, update, accumulation, key rule) fails here.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import random_batch
from reference import LossScale, Reference, float64_steps
from tolerance import assert_state_reassociated

import jaxtrain as jt
from jaxtrain import models
from jaxtrain.models import lenet, resnet

STEPS = 4
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.2), "adam": lambda: optax.adam(1e-2, eps=1e-6)}  # eps: see test_step
# fp16 starts at 2^18: LeNet's first step overflows and is skipped (the scale halves), the next two update and
# the scale grows (every 2 finite steps), the fourth overflows again: skips, updates and growth (SGD; Adam's
# larger moves overflow more often).
FP16 = {"initial_scale": 2.0**18, "growth_interval": 2}
# fp32 follows the tolerance policy (tests/tolerance.py). bf16/fp16: the same program compiled twice; measured
# here they were bit-identical but for MultiSteps' running mean and the scan's loss mean (re-associated sums:
# <= 1.6e-6 absolute after 4 Adam steps: bf16/fp16 round the same values the same way). 1e-5 is 1000x below one
# update (SGD lr 0.2, Adam lr 1e-2: ~1e-2 per parameter), so a skipped, doubled or wrongly scaled update fails.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def run_both(loss_fn, params, model_state, batches, make_tx, precision, accum_steps=1, accum="scan", fp16=FP16):
    """(jaxtrain's final state and metrics, the reference after the same batches and its metrics)."""
    policy = jt.Precision(compute_dtype=jnp.float16, loss_scale="dynamic", **fp16) if precision == "fp16" else precision
    trainer = jt.make_train_step(loss_fn, make_tx(), mesh=1, precision=policy, accum_steps=accum_steps, accum=accum)
    state = trainer.init(params, model_state, rng=jax.random.key(7))
    ref = Reference(loss_fn, make_tx(), params, model_state, rng=jax.random.key(7), precision=precision,
                    accum_steps=accum_steps, accum=accum,
                    loss_scale=LossScale(fp16["initial_scale"], growth=fp16["growth_interval"]))
    got, want = [], []
    for batch in batches:
        state, metrics = trainer(state, batch)
        got.append(jax.device_get(metrics))
        want.append(ref.step(batch))
    return jax.device_get(state), got, ref, want


def exact_for(ref, params, model_state, batches):
    """The float64 run of ``ref``'s steps (tests/tolerance.py), or None for bf16/fp16."""
    if ref.dtype != jnp.float32:
        return None
    return float64_steps(ref.loss_fn, ref.tx, params, batches, model_state, rng=jax.random.key(7),
                         accum_steps=ref.k, accum=ref.accum)


def assert_same(state, got, ref, want, tol, initial_params, moves=1e-3, exact=None):
    """fp32 (``exact`` given): by the tolerance policy (tests/tolerance.py); bf16/fp16: within ``tol`` of the
    same-precision reference."""
    assert int(state.step) == ref.step_count == len(want)
    opt_state = state.opt_state.inner_opt_state if ref.accum == "multisteps" and ref.k > 1 else state.opt_state
    if exact is not None:
        theirs = state.replace(params=ref.params, opt_state=ref.opt_state, model_state=ref.model_state)
        assert_state_reassociated(state.replace(opt_state=opt_state), got, jax.device_get(theirs), want, exact)
    else:
        chex.assert_trees_all_close(state.params, jax.device_get(ref.params), **tol)
        chex.assert_trees_all_close(opt_state, jax.device_get(ref.opt_state), **tol)
        chex.assert_trees_all_close(state.model_state, jax.device_get(ref.model_state), **tol)
        chex.assert_trees_all_close(got, want, **tol)
    if ref.loss_scale is not None:
        assert float(state.loss_scale["scale"]) == ref.loss_scale.scale
        assert int(state.loss_scale["good_steps"]) == ref.loss_scale.good
    # The runs moved the parameters by far more than the tolerance (a skipped update would show).
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.params),
                                                            jax.tree.leaves(jax.device_get(initial_params))))
    assert moved > moves, moved
    if ref.loss_scale is not None:  # the loss scale did skip and update
        finite = [float(m["grads_finite"]) for m in want]
        assert 0.0 in finite and 1.0 in finite, finite


LENET_BATCHES = [random_batch(32, seed=s) for s in range(STEPS)]


@pytest.mark.parametrize("accum", ["none", "scan", "multisteps"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_lenet_one_device_step_equals_the_reference(opt, precision, accum):
    params = lenet.init_params(jax.random.key(0), scale=0.1)
    k, mode = (1, "scan") if accum == "none" else (2, accum)
    state, got, ref, want = run_both(lenet.loss_fn, params, {}, LENET_BATCHES, OPTIMIZERS[opt], precision, k, mode)
    assert_same(state, got, ref, want, TOL, params, exact=exact_for(ref, params, {}, LENET_BATCHES))
    if precision == "fp16":  # ... and grew
        scales = [float(m["loss_scale"]) for m in want] + [ref.loss_scale.scale]
        assert opt == "adam" or any(b > a for a, b in zip(scales, scales[1:])), scales


# ResNet-18 (its BatchNorm statistics are model state). bf16 / fp16: He init at SGD lr 3e-3 (d2l's lr 0.1 on 8
# random images diverges there: loss 4.8 -> 25 -> 46), 3 calls (fp16 starts at 2^16: the first two steps overflow,
# the third updates). fp32 is held to float64 leaf by leaf (tests/tolerance.py): one update (multisteps: its 2
# calls) of test_resnet's d2l weights, the configuration whose step is well-conditioned leaf by leaf; He init's is
# not (one ReLU input 5e-6 from 0 at block 4 rounds positive in some fp32 programs, and its gradient term moves
# every upstream leaf by 0.5% of its move: docs/testing.md). SGD only: Adam moves an element whose gradient is
# rounding (a conv bias before a BatchNorm, a kernel's near-zero entries) by up to a whole lr in the sign of that
# rounding, so its fp32 reference is 2x a kernel's move from float64 and a per-leaf check says nothing (LeNet
# covers Adam x every precision and accumulation).
RESNET_TX = {"sgd": lambda: optax.sgd(3e-3)}
RESNET_FP32_TX = {"sgd": lambda: optax.sgd(0.1)}
RESNET_FP16 = {"initial_scale": 2.0**16, "growth_interval": 2}
# SGD x fp32 without accumulation is test_resnet's `reference` (the same weights and step, held to the reference
# before the 2-device runs are held to it).
RESNET_CASES = [("sgd", "bf16", "none"), ("sgd", "fp16", "none"), ("sgd", "fp32", "scan"),
                ("sgd", "fp32", "multisteps")]


@pytest.mark.slow  # ~25 s each: the first leg runs them, CI's newest-JAX leg does not
@pytest.mark.parametrize(("opt", "precision", "accum"), RESNET_CASES)
def test_resnet18_one_device_step_equals_the_reference(opt, precision, accum):
    k, mode = (1, "scan") if accum == "none" else (2, accum)
    if precision == "fp32":
        from test_resnet import BATCH, variables

        params, model_state = variables.__wrapped__()
        batches, tx = [BATCH] if mode == "scan" else [BATCH, random_batch(8, seed=12)], RESNET_FP32_TX[opt]
        loss_fn = resnet.adapter().loss_fn  # XLA's convolutions (oneDNN's: test_onednn)
    else:
        model = models.get("resnet18", init="he")
        params, model_state = model.init(jax.random.key(0))
        batches, tx, loss_fn = [random_batch(8, seed=10 + s) for s in range(3)], RESNET_TX[opt], model.loss_fn
    state, got, ref, want = run_both(loss_fn, params, model_state, batches, tx, precision, k, mode, fp16=RESNET_FP16)
    exact = exact_for(ref, params, model_state, batches)
    assert_same(state, got, ref, want, TOL, params, moves=1e-3 if precision != "fp32" else 1e-4, exact=exact)


def test_the_key_rulereaches_the_loss_fn_as_documented():
    """A loss that returns the key's bits as metrics: jaxtrain's and the reference's keys are the same."""

    def loss_fn(params, model_state, batch, rng):
        bits = jax.random.key_data(rng).astype(jnp.float32)
        loss = jnp.mean((batch["image"].reshape(batch["image"].shape[0], -1) @ params["w"]) ** 2)
        return loss, (model_state, {"k0": bits[0], "k1": bits[1]})

    params = {"w": jnp.full((784, 1), 1e-3)}
    for accum_steps, accum in ((1, "scan"), (2, "scan"), (2, "multisteps")):
        trainer = jt.make_train_step(loss_fn, optax.sgd(0.1), mesh=1, accum_steps=accum_steps, accum=accum)
        state = trainer.init(params, rng=jax.random.key(3))
        ref = Reference(loss_fn, optax.sgd(0.1), params, rng=jax.random.key(3), accum_steps=accum_steps,
                        accum=accum)
        for batch in LENET_BATCHES[:3]:
            state, metrics = trainer(state, batch)
            want = ref.step(batch)
            # With scan accumulation the metrics are means over the micro-batches' keys: equal means, same keys.
            assert float(metrics["k0"]) == float(want["k0"]) and float(metrics["k1"]) == float(want["k1"])
