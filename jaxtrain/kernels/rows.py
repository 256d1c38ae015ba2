"""Row-block Pallas kernels: how jaxtrain's kernels cut [N, D] operands into blocks, and run on CPU or GPU.

A 1-D grid; program ``i`` owns ``R = block_rows(D)`` rows (16, fewer for rows wider than 1024) and all D
columns, held as one [R, next_power_of_2(D)] tile (Triton wants power-of-two shapes). Operands come in four kinds:
``ROWS`` [N, D] (a tile per program), ``ROW`` [N] (a value per row), ``COLS`` [D] (the same vector for every
program, e.g. a layer norm's scale) and ``BLOCK`` [programs, D] (one row per program: per-block partial
sums, which ``run`` adds up). Kernels mask by the true N and D (``tile``) and read / write through ``read`` /
``write``.

Where the step is lowered for a CPU the kernels run in Pallas interpret mode, for a GPU through Triton or, on
Hopper and newer GPUs with jax >= 0.12, through Mosaic GPU (``backend``; the kernels' Mosaic GPU versions are in
``jaxtrain.kernels.mosaic``): ``run`` picks at lowering time (``lax.platform_dependent``), so one traced step
lowers for either. On GPUs a
partial last block is a masked load / store. In interpret mode the operands are padded to whole blocks
first: interpret mode pads partial blocks itself (and every masked load), with a pad value that does not vary
over the mesh axes, which ``shard_map(check_vma=True)`` refuses; padded here with a varying value, the
kernels read whole blocks plainly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from jaxtrain import settings
from jaxtrain.core import compat
from jaxtrain.core.context import step_context
from jaxtrain.errors import ConfigError
from jaxtrain.parallel.devices import DATA_AXIS, batch_axes
from jaxtrain.parallel.sharding import axes_of

MAX_ROWS = 16  # rows per program for rows up to 1024 wide
TILE = 16 * 1024  # elements per program's tile: 128 fp32 registers a thread at 4 warps (8 warps past 1024 wide)


def block_rows(cols: int) -> int:
    """Rows per program: a power of two, fewer for wide rows so that a tile holds <= TILE elements (>= 1 row)."""
    return max(1, min(MAX_ROWS, TILE // pl.next_power_of_2(cols)))


def num_warps(cols: int) -> int:
    return 4 if pl.next_power_of_2(cols) <= 1024 else 8


def programs(rows: int, cols: int) -> int:
    """How many programs (row blocks) a [rows, cols] problem runs: the leading size of BLOCK operands."""
    return pl.cdiv(rows, block_rows(cols))
ROWS, ROW, COLS, BLOCK = "rows", "row", "cols", "block"  # operand kinds (module docstring)


def tile(rows: int, cols: int):
    """(row mask [R], column ids [Dp], valid-element mask [R, Dp]) of this program's tile."""
    row_ok = pl.program_id(0) * block_rows(cols) + jnp.arange(block_rows(cols)) < rows
    col_ids = jnp.arange(pl.next_power_of_2(cols))
    return row_ok, col_ids, row_ok[:, None] & (col_ids[None, :] < cols)


def read(ref, mask, other, triton: bool):
    """The block, ``other`` where ``mask`` is off: a masked load on GPUs (a block may overrun the array), a
    plain read of the padded block in interpret mode."""
    if triton:
        return plgpu.load(ref.at[tuple(pl.ds(0, n) for n in mask.shape)], mask=mask, other=other)
    return jnp.where(mask, ref[...], other)


def write(ref, value, mask, triton: bool):
    if triton:
        plgpu.store(ref.at[tuple(pl.ds(0, n) for n in mask.shape)], value, mask=mask)
    else:
        ref[...] = value  # the padding is cut off after the call


def _result(shape, dtype, inputs) -> jax.ShapeDtypeStruct:
    """An output's type; inside ``shard_map`` it varies over the mesh axes its inputs vary over (check_vma)."""
    varying = _varying(inputs)
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _varying(inputs) -> frozenset:
    return frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in inputs))


def _vary_as(arrays, axes: frozenset) -> tuple:
    """``arrays`` cast to vary over ``axes`` (inside ``shard_map``): a kernel's results vary as its inputs do."""
    out = []
    for a in arrays:
        missing = tuple(axes - jax.typeof(a).manual_axis_type.varying)
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return tuple(out)


def vary_like(arrays, like) -> tuple:
    """``arrays`` cast to vary over the mesh axes ``like`` varies over (inside ``shard_map``; else as they are)."""
    return _vary_as(arrays, jax.typeof(like).manual_axis_type.varying)


def _spec(kind: str, cols: int) -> pl.BlockSpec:
    wide, n = pl.next_power_of_2(cols), block_rows(cols)
    return {ROWS: pl.BlockSpec((n, wide), lambda i: (i, 0)), ROW: pl.BlockSpec((n,), lambda i: (i,)),
            COLS: pl.BlockSpec((wide,), lambda i: (0,)), BLOCK: pl.BlockSpec((1, wide), lambda i: (i, 0))}[kind]


def _call(kernel, inputs, kinds, outputs, out_kinds, rows, cols, interpret):
    return tuple(pl.pallas_call(
        functools.partial(kernel, rows=rows, cols=cols, triton=not interpret), grid=(programs(rows, cols),),
        in_specs=[_spec(k, cols) for k in kinds], out_specs=[_spec(k, cols) for k in out_kinds], out_shape=outputs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps(cols), num_stages=1), interpret=interpret,
        name=f"{kernel.__module__.rsplit('.', 1)[-1]}{kernel.__name__}")(*inputs))


def _padded_shape(kind: str, shape: tuple, rows: int, cols: int) -> tuple:
    full_rows, wide = rows + -rows % block_rows(cols), pl.next_power_of_2(cols)
    return {ROWS: (full_rows, wide), ROW: (full_rows,), COLS: (wide,), BLOCK: (shape[0], wide)}[kind]


def _pad(a, shape):
    (value,) = vary_like((jnp.zeros((), a.dtype),), a)  # jnp.pad's own pad value would not vary like ``a``
    return jax.lax.pad(a, value, [(0, n - m, 0) for n, m in zip(shape, a.shape)])


def _interpret(kernel, inputs, kinds, outputs, out_kinds, rows, cols):
    grown = [jax.ShapeDtypeStruct(_padded_shape(k, o.shape, rows, cols), o.dtype,
                                  **({"manual_axis_type": o.manual_axis_type} if o.manual_axis_type else {}))
             for o, k in zip(outputs, out_kinds)]
    padded = [_pad(a, _padded_shape(k, a.shape, rows, cols)) for a, k in zip(inputs, kinds)]
    outs = _call(kernel, padded, kinds, grown, out_kinds, rows, cols, interpret=True)
    return tuple(o[tuple(slice(0, n) for n in spec.shape)] for o, spec in zip(outs, outputs))


MOSAIC_MIN_CAPABILITY = 9.0  # Mosaic GPU: Hopper (sm_90) and newer
HOPPER_OR_NEWER = ("H100", "H200", "H800", "H20", "GH200", "B100", "B200", "B300", "GB200", "GB300")  # device kinds


def _hopper_or_newer(mesh) -> bool | None:
    """Whether ``mesh``'s GPUs (else JAX's default devices) are Hopper or newer; None where that is not known."""
    if isinstance(mesh, jax.sharding.AbstractMesh) and getattr(mesh, "abstract_device", None) is not None:
        kind = mesh.abstract_device.device_kind  # a jit traced under a mesh of GPUs, even compile-only ones
        return any(name in kind.split() for name in HOPPER_OR_NEWER) if mesh.abstract_device.platform == "gpu" else None
    devices = mesh.devices.flat if isinstance(mesh, jax.sharding.Mesh) else jax.devices()
    capability = getattr(next(iter(devices)), "compute_capability", None)
    return None if capability is None else float(capability) >= MOSAIC_MIN_CAPABILITY


def backend(mesh=None) -> str:
    """The GPU backend of the kernels: ``"mosaic"`` (Mosaic GPU) where jax >= 0.12 and the GPU (``mesh``'s
    devices, else JAX's default devices) is a Hopper or newer, else ``"triton"``. A GPU not known here (a CPU
    host, an unnamed kind) gets Triton, which lowers for any. ``JAXTRAIN_PALLAS_GPU=mosaic|triton``
    (``settings.pallas_gpu``) overrides."""
    forced = settings.current().pallas_gpu
    if forced == "triton" or not compat.MOSAIC_GPU_KERNELS:
        return "triton"
    return "mosaic" if forced == "mosaic" or _hopper_or_newer(mesh) else "triton"


def interpreted() -> str:
    """Which version of the kernels runs on CPUs, in interpret mode: ``"triton"`` (Pallas's generic interpret
    mode; the default) or ``"mosaic"`` (Mosaic GPU's interpret mode, jax >= 0.12: slower; tests use it to
    prove the Mosaic GPU kernels equal to their references), by ``JAXTRAIN_PALLAS_INTERPRET``
    (``settings.pallas_interpret``)."""
    chosen = settings.current().pallas_interpret
    if chosen == "mosaic" and not compat.MOSAIC_GPU_KERNELS:
        raise ConfigError(f"{settings.VARIABLES['pallas_interpret']}=mosaic needs jax >= 0.12 (Mosaic GPU's "
                          "interpret mode)")
    return chosen


def _here(kernel, inputs, kinds, outputs, rows, cols, mosaic, mesh):
    shapes = {ROWS: (rows, cols), ROW: (rows,), BLOCK: (programs(rows, cols), cols)}
    structs = [_result(shapes[kind], dtype, inputs) for kind, dtype in outputs]
    out_kinds = [kind for kind, _ in outputs]

    def summed(outs):
        return tuple(o.sum(0, keepdims=True) if k == BLOCK else o for o, k in zip(outs, out_kinds))

    def on_mosaic(*a, interpret=False):
        outs = mosaic(*a, interpret=interpret)
        return _vary_as([o.reshape(1, -1) if k == BLOCK else o for o, k in zip(outs, out_kinds)], _varying(a))

    def interpreted_here(*a):
        return summed(_interpret(kernel, a, kinds, structs, out_kinds, rows, cols))

    gpu = {"cuda": on_mosaic} if mosaic is not None and backend(mesh) == "mosaic" else {}
    if mosaic is not None and interpreted() == "mosaic":
        cpu = functools.partial(on_mosaic, interpret=True)
    else:
        cpu = interpreted_here
    return jax.lax.platform_dependent(
        *inputs, cpu=cpu, **gpu,
        default=lambda *a: summed(_call(kernel, a, kinds, structs, out_kinds, rows, cols, interpret=False)))


def run(kernel, inputs, kinds, outputs, rows: int, cols: int, mosaic=None):
    """``kernel(*in_refs, *out_refs, rows=, cols=, triton=)`` over the row blocks of a [rows, cols] problem;
    ``inputs`` of the given kinds, ``outputs`` as (kind, dtype) pairs. Returns the outputs; a BLOCK one summed
    over the blocks, as one row [1, cols] (per device, stacked, when the rows are split over the devices).
    ``mosaic(*inputs, interpret=)``: the same on Mosaic GPU (BLOCK outputs as their sums [cols]), where
    ``backend`` says so (and on CPUs where ``interpreted`` does).

    Inside a train step whose loss sees the whole batch (jaxtrain's ``jit`` strategy: ``jt.step_context()``
    has no batch axis), the rows are split over the mesh's ``"data"`` axis with ``shard_map``: each device
    runs the kernel on its own rows. Left to GSPMD, which cannot split a kernel, every device would gather
    all rows and run all of them. Outside a jaxtrain step, the mesh your own ``jax.jit`` traces under
    (``jax.sharding.use_abstract_mesh``) is split the same way where its "data" axis is not manual yet."""
    ctx = step_context()
    if ctx is not None:
        target = ctx.mesh  # whose devices the step runs on (backend)
        # strategy="explicit" traces the step under jax.set_mesh, the model's insides with Auto axes: the
        # shard_map's mesh must be that context mesh (as typed there), not the step's Explicit one.
        context = jax.sharding.get_abstract_mesh()
        mesh = (context if context.axis_names else ctx.mesh) if ctx.batch_axis is None else None
    else:
        target = mesh = jax.sharding.get_abstract_mesh()
        mesh = mesh if mesh.axis_names and DATA_AXIS not in mesh.manual_axes else None
    axes = batch_axes(mesh) if mesh is not None else DATA_AXIS  # a hybrid mesh: "replica" and "data"
    names = axes_of(axes)
    devices = math.prod(dict(mesh.shape).get(a, 1) for a in names) if mesh is not None else 1
    if devices > 1 and rows % devices == 0:
        def spec(kind):
            return P() if kind == COLS else P(axes)

        def local(*a):
            return _here(kernel, a, kinds, outputs, rows // devices, cols, mosaic, target)

        return jax.shard_map(local, mesh=mesh, in_specs=tuple(map(spec, kinds)),
                             out_specs=tuple(spec(kind) for kind, _ in outputs),
                             axis_names=set(names))(*inputs)
    return _here(kernel, inputs, kinds, outputs, rows, cols, mosaic, target)

