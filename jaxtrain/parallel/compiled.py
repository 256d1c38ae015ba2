"""A strategy's compiled step, called and lowered: for a plain jit, under an explicit-sharding mesh, or a pmap
(whose ``lower`` takes no shapes or platforms). ``lower(state, batch, platforms)`` lowers for arrays or shapes,
e.g. for ``("cuda",)`` on a CPU host."""

from __future__ import annotations

import contextlib

import jax

from jaxtrain.errors import ConfigError
from jaxtrain.parallel import sharding


class Compiled:
    """A wrapped step: call it, or ``lower(state, batch, platforms)`` it (e.g. ``("cuda",)`` on a CPU host)."""

    def __init__(self, jitted, prepare=lambda batch: batch):
        self._jitted, self._prepare = jitted, prepare

    def __call__(self, state, batch):
        return self._jitted(state, self._prepare(batch))

    def lower(self, state, batch, platforms: tuple[str, ...] | None = None):
        return self._jitted.trace(state, self._prepare(batch)).lower(lowering_platforms=platforms)


class UnderMesh(Compiled):
    """A compiled step called and lowered under ``jax.set_mesh(mesh)`` (what explicit sharding reads); a model
    traced with typed arrays (``model_axes="explicit"``) that does not type-check is a one-line ConfigError."""

    def __init__(self, compiled: Compiled, mesh, model_axes: str):
        super().__init__(compiled)
        self._mesh, self._model_axes = mesh, model_axes

    def __call__(self, state, batch):
        with jax.set_mesh(self._mesh), self._typed():
            return self._jitted(state, batch)

    def lower(self, state, batch, platforms: tuple[str, ...] | None = None):
        with jax.set_mesh(self._mesh), self._typed():
            return self._jitted.lower(state, batch, platforms)

    @contextlib.contextmanager
    def _typed(self):
        try:
            yield
        except Exception as e:  # jax's ShardingTypeError has no public name
            if type(e).__name__ != "ShardingTypeError" or self._model_axes != "explicit":
                raise
            first = str(e).strip().splitlines()[0]
            raise ConfigError(f"the model does not type-check under explicit sharding (model_axes='explicit'): "
                              f"{first} Give its layers the shardings (jax.sharding.reshard, out_sharding=), or "
                              "pass model_axes='auto' to run it under jax.sharding.auto_axes") from e


class Pmapped(Compiled):
    """``jax.pmap``'s own ``lower`` takes neither platforms nor shapes: those lower the same pmap under a jit."""

    def __init__(self, pmapped, prepare, donate):
        super().__init__(pmapped, prepare)
        self._under_jit = jax.jit(lambda state, batch: pmapped(state, prepare(batch)), donate_argnums=donate)

    def lower(self, state, batch, platforms: tuple[str, ...] | None = None):
        if platforms is None and not sharding.is_abstract(batch):
            return self._jitted.lower(state, self._prepare(batch))
        return self._under_jit.trace(state, batch).lower(lowering_platforms=platforms)
