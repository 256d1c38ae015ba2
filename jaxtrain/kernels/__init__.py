"""Pallas kernels, each beside its ``jnp`` reference (docs/kernels.md); opt-in with ``kernels="pallas"``.
``onednn``: oneDNN's convolutions for CPUs (``conv="auto"``, the models' default)."""
