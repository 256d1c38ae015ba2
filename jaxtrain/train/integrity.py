"""What a checkpoint vouches for: a sharding-independent digest of its state, its layout, its settings.

``state_digest`` hashes every element's bits together with its position, on
the devices where the arrays already live: each element becomes a 32-bit
mix of (bits, index) and the mixes are summed modulo 2**32 (twice, with two
seeds). Integer sums do not depend on the reduction order, so the digest is
the same for any sharding, device count or process count, and nothing is
copied to the host but 8 bytes per leaf. A flipped byte changes its
element's mix and therefore the sum (up to a 2**-64 chance per leaf).
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

_SEEDS = (0x9E3779B1, 0x7F4A7C15)


def _fmix(x):
    """murmur3's 32-bit finaliser: every input bit reaches every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x) -> jax.Array:
    """The leaf's bits as a flat uint32 vector (one word per 1-, 2- or 4-byte element, two per 8-byte one)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


@jax.jit
def _leaf_sums(leaves):
    out = []
    for x in leaves:
        w = _words(x)
        i = jax.lax.iota(jnp.uint32, w.size)
        out.append(jnp.stack([jnp.sum(_fmix(w ^ _fmix(i + jnp.uint32(s))), dtype=jnp.uint32) for s in _SEEDS]))
    return out


def layout(tree) -> list[list]:
    """[path, shape, dtype] of every leaf: the structure a checkpoint was written with (JSON-able)."""
    rows = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        dtype = "key" if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else str(x.dtype)
        rows.append([jax.tree_util.keystr(path), list(x.shape), dtype])
    return rows


def state_digest(tree) -> str:
    """Hex digest of every leaf's bits and position (and the tree's layout); sharding-independent."""
    leaves = [x for x in jax.tree.leaves(tree) if x is not None]
    h = hashlib.sha256(json.dumps(layout(tree)).encode())
    for sums in jax.device_get(_leaf_sums(leaves)):
        h.update(np.asarray(sums, np.uint32).tobytes())
    return h.hexdigest()


def json_digest(obj) -> str:
    """sha256 of a JSON-able object, keys sorted (e.g. the loop position)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def layout_differences(saved: list[list], current: list[list], limit: int = 3) -> list[str]:
    """Human-readable differences between two ``layout`` lists ([] when equal)."""
    a = {row[0]: row[1:] for row in saved}
    b = {row[0]: row[1:] for row in current}
    diffs = [f"{k}: {a.get(k, 'absent')} in the checkpoint, {b.get(k, 'absent')} now"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return diffs[:limit] + ([f"... {len(diffs) - limit} more"] if len(diffs) > limit else [])
