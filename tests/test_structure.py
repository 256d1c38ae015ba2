"""What the compiled train step contains: collectives, donation, no host round-trips."""

import re

import jax
import numpy as np
import optax
import pytest
from conftest import random_batch

import jaxtrain as jt
from jaxtrain.models import lenet

COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|collective-permute|all-gather)(-start)?\(")
SHAPE = re.compile(r"(f32|bf16|f16|s32|u32)\[([0-9,]*)\]")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}


def compiled(strategy, accum_steps=1, n=2):
    trainer = jt.make_train_step(lenet.loss_fn, optax.adam(1e-3), mesh=n, strategy=strategy, accum_steps=accum_steps)
    state = trainer.init(lenet.init_params(jax.random.key(0)))
    return trainer, state, trainer.lower(state, random_batch(256)).compile()


def collectives(hlo: str):
    """(count, bytes moved) of the collective ops in an HLO module's text."""
    count = total = 0
    for line in hlo.splitlines():
        if COLLECTIVE.search(line) and "=" in line:
            count += 1
            lhs = line.split("=", 1)[1].split(COLLECTIVE.search(line).group(0))[0]  # the result type(s)
            for dtype, dims in SHAPE.findall(lhs):
                total += BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return count, total


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_gradients_are_reduced_once_per_update_whatever_accum_steps(strategy):
    _, state, exe = compiled(strategy, 1)
    one = collectives(exe.as_text())
    four = collectives(compiled(strategy, 4)[2].as_text())
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    assert one[0] > 0 and one[1] >= param_bytes, (one, param_bytes)  # the gradients cross the devices
    assert four == one, (one, four)  # neither more ops nor more bytes with 4 micro-batches


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_no_collective_inside_a_loop_and_no_host_round_trips(strategy):
    hlo = compiled(strategy, 4)[2].as_text()
    assert COLLECTIVE.search(hlo)
    # On CPU the micro-batch scan is unrolled (XLA:CPU runs convs in loops ~12x slower),
    # so no loop is left that could hold a collective.
    assert " while(" not in hlo
    for op in ("outfeed", "infeed", "host-callback", "xla_python_cpu_callback", "send(", "recv("):
        assert op not in hlo, op
    assert not ynn_fused_ops(hlo) & {"convolution", "dot"}  # jaxtrain's CPU flags reach every strategy


def ynn_fused_ops(hlo: str) -> set[str]:
    """The ops inside the computations that XLA:CPU hands to YNNPACK fusions."""
    called = set(re.findall(r"calls=(%[\w.-]+)[^\n]*__ynn_fusion", hlo))
    ops, inside = set(), False
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a computation's header (or its closing brace)
            inside = line.split(" ")[0] in called
        elif inside and "=" in line:
            ops.update(re.findall(r"\b([a-z-]+)\(", line.split("=", 1)[1])[:1])
    return ops


def test_ynn_fusion_parser_sees_convolutions_under_xla_defaults():
    """The check above can fail: under XLA's defaults the convolutions are YNNPACK fusions."""
    from conftest import run_cli

    code = ("import jax, jax.numpy as jnp, sys; sys.path.insert(0, 'tests'); from test_structure import ynn_fused_ops; "
            "f = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), 'VALID', "
            "dimension_numbers=('NHWC', 'HWIO', 'NHWC')); "
            "print(sorted(ynn_fused_ops(jax.jit(f).lower(jnp.ones((8, 13, 13, 20)), jnp.ones((5, 5, 20, 50)))"
            ".compile().as_text())))")
    out = run_cli("-c", code, env={"JAXTRAIN_XLA_DEFAULTS": "1", "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr
    assert "convolution" in out.stdout, out.stdout


@pytest.mark.parametrize("strategy", jt.STRATEGIES)
def test_params_and_optimizer_state_are_donated(strategy):
    _, state, exe = compiled(strategy)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state.params, state.opt_state)))
    alias = exe.memory_analysis().alias_size_in_bytes
    assert alias >= state_bytes, (alias, state_bytes)  # every params / optimizer buffer is written in place
