"""Pallas kernels, each beside its ``jnp`` reference (docs/kernels.md); opt-in with ``kernels="pallas"``."""
