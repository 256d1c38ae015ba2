"""Rematerialization: policy names -> ``jax.checkpoint`` with that policy.

A remat policy decides which intermediate values of a block are saved for
the backward pass; the rest is recomputed there. Names:

- ``none``: no remat, everything the backward pass needs is saved;
- ``full``: save nothing inside the block (only its inputs), recompute all;
- ``dots``: save matmul/conv results, recompute the cheap elementwise ops;
- ``dots_no_batch``: save only matmuls without batch dimensions;
- ``offload_dots``: matmul/conv results saved as ``dots`` saves them, but in the host's pinned memory
  (``pinned_host``): the device keeps none of them, the backward pass copies them back. Nothing is recomputed;
  the cost is the transfers (PCIe or NVLink-C2C), which XLA overlaps with compute where it can;
- ``offload_dots_no_batch``: the same for matmuls without batch dimensions (JAX's
  ``offload_dot_with_no_batch_dims``, MaxText's ``*_offloaded`` policies);
- ``offload_names:NAME,...``: offload the values a model names with ``jax.ad_checkpoint.checkpoint_name``
  (the ViT's: ``qkv``, ``attention``, ``mlp_hidden``), recompute the rest;
- any other attribute of ``jax.checkpoint_policies`` that is a policy itself
  (e.g. ``everything_saveable``, ``nothing_saveable``).

Offloading is for GPUs (and TPUs), whose device memory is not the host's. A CPU has one memory: XLA:CPU keeps
the offloaded values where they are, so there an offload policy computes and holds what its saving twin does
(``offload_dots`` as ``dots``), and ``offload_note`` says so.

``materialize(x)`` is the other way round, inside one compiled program: a value XLA:CPU would recompute in
each of its readers is stored once (ResNet-18's conv inputs).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax

from jaxtrain import settings
from jaxtrain.errors import ConfigError

OFFLOAD_NAMES = "offload_names:"
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"
_ALIASES = {
    "full": "nothing_saveable",
    "dots": "dots_saveable",
    "dots_no_batch": "dots_with_no_batch_dims_saveable",
}


def _is_policy(obj) -> bool:
    """A policy takes (primitive, *avals, **params); factories (save_only_these_names) take no **params."""
    if not callable(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_KEYWORD for p in params)


def _offload_dots(prim, *args, **params):
    """``dots_saveable``'s values (matmuls, convolutions), offloaded to the host instead of kept."""
    from jaxtrain.core.compat import offloadable

    if jax.checkpoint_policies.dots_saveable(prim, *args, **params):
        return offloadable(OFFLOAD_SRC, OFFLOAD_DST)
    return False


_OFFLOADS = {
    "offload_dots": lambda: _offload_dots,
    "offload_dots_no_batch": lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims(OFFLOAD_SRC, OFFLOAD_DST),
}


def names() -> list[str]:
    """Every name ``policy`` accepts (``offload_names:`` takes the model's value names after it)."""
    own = [n for n in dir(jax.checkpoint_policies) if not n.startswith("_")
           and _is_policy(getattr(jax.checkpoint_policies, n))]
    return ["none", *_ALIASES, *_OFFLOADS, OFFLOAD_NAMES + "NAME,...",
            *sorted(set(own) - set(_ALIASES.values())), *_ALIASES.values()]


def offloads(name: str) -> bool:
    """Whether the policy ``name`` offloads residuals to the host."""
    return name in _OFFLOADS or name.startswith(OFFLOAD_NAMES)


def offload_note(name: str, platform: str) -> str | None:
    """The line a run prints where its offload policy cannot offload (a CPU), else None; ConfigError for a name
    ``policy`` does not know."""
    policy(name)
    if not offloads(name) or platform != "cpu":  # GPUs and TPUs have memory of their own
        return None
    return (f"remat {name}: a {platform.upper()} has one memory, so the offloaded values stay where they are: this "
            f"run computes and holds what the policy's saving twin would (GPUs move them to pinned host memory)")


def policy(name: str):
    """The ``jax.checkpoint_policies`` member for ``name`` (None for ``none``)."""
    if name == "none":
        return None
    if name in _OFFLOADS:
        return _OFFLOADS[name]()
    if name.startswith(OFFLOAD_NAMES):
        values = tuple(v.strip() for v in name[len(OFFLOAD_NAMES):].split(","))
        if not all(v.isidentifier() for v in values):
            raise ConfigError(f"remat {name!r}: name the values to offload, e.g. {OFFLOAD_NAMES}mlp_hidden,attention")
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=values, offload_src=OFFLOAD_SRC,
            offload_dst=OFFLOAD_DST)
    attr = _ALIASES.get(name, name)
    obj = getattr(jax.checkpoint_policies, attr, None)
    if obj is None or not _is_policy(obj):
        raise ConfigError(f"unknown remat policy {name!r}: use one of {', '.join(names())}")
    return obj


def remat(fn: Callable, name: str) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the named policy (``fn`` for ``none``)."""
    pol = policy(name)
    return fn if pol is None else jax.checkpoint(fn, policy=pol)


def materialize(x):
    """``x`` (an array or a pytree), kept in memory on XLA:CPU; unchanged on other platforms.

    XLA:CPU copies a chain of elementwise ops (BatchNorm, ReLU, residual adds) into EACH fusion that reads its
    result, so the chain is recomputed there. Where that reader is the relayout feeding a convolution's weight
    gradient ([B, H, W, C] -> [C, H, W, B]), the fused relayout reads several activations in transposed order:
    ResNet-18's largest ran about ten times slower than a relayout of one stored array (docs/performance.md,
    "ResNet-18 on this CPU"). Passing ``x`` through a conditional, which XLA cannot fuse into or fold away, makes
    it stored once and read by every consumer. Both branches return ``x``, so the value is exact; the predicate
    is a bit from ``rng_bit_generator`` (a replicated value that needs no collective under any sharding, and no
    constant XLA could fold). GPUs and TPUs get ``x`` as it is (``platform_dependent``): their convolutions take
    any layout, and a conditional may cost a host sync there.
    ``JAXTRAIN_NO_MATERIALIZE=1`` (``settings.no_materialize``) turns it off, to measure what it buys
    (``python -m experiments.bench --model resnet18 --no-materialize``).
    """
    if settings.current().no_materialize:
        return x

    def kept(t):
        _, bits = jax.lax.rng_bit_generator(jax.numpy.zeros((4,), "uint32"), (1,), "uint32")
        # Two branches that XLA cannot tell apart would be merged and the conditional removed; ``u * 1`` is
        # ``u``, bit for bit (NaNs and infinities included).
        return jax.lax.cond(bits[0] % 2 == 0, lambda u: u, lambda u: jax.tree.map(lambda a: a * 1, u), t)

    return jax.lax.platform_dependent(x, cpu=kept, default=lambda t: t)
