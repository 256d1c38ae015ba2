"""What each kernel of a compiled GPU program asks of an SM: grid, threads, shared memory and registers per launch.

Read from what the compile leaves, no GPU needed:

- XLA's kernels and Pallas's Triton kernels: XLA writes their launch dimensions and dynamic shared memory in its
  thunk sequence (``xla_dump_to``) and their cubins into its kernel cache file (``xla_gpu_kernel_cache_file``);
  a cubin's ``.nv.info`` section holds each kernel's register count (EIATTR_REGCOUNT) and its
  ``.nv.shared.<kernel>`` section the static shared memory.
- Pallas's Mosaic GPU kernels: the custom call carries the kernel as an MLIR module, whose ``gpu.launch`` names
  the grid, the block and the dynamic shared memory. Mosaic turns that module into a cubin only when the kernel
  first runs on a GPU, so its registers are not known before (``registers`` None).
"""

from __future__ import annotations

import dataclasses
import re
import struct
import tempfile
from pathlib import Path

_THUNK = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]"
                    r"\s+shared_memory: (\d+) bytes")
_TRITON_NAME = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?name = "([^"]+)"')
_MOSAIC = re.compile(r'custom_call_target="mosaic_gpu_v2".*?op_name="([^"]*)".*?module = "((?:[^"\\]|\\.)*)"')
EIATTR_REGCOUNT, EIFMT_SVAL = 0x2F, 0x04


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    backend: str  # "triton" (a Pallas Triton kernel), "mosaic" (a Pallas Mosaic GPU kernel) or "xla"
    grid: tuple[int, int, int]
    threads: int  # per block
    shared_bytes: int  # per block: dynamic + static
    registers: int | None  # per thread; None: decided when the kernel first runs (Mosaic GPU)


def compile_with_launches(lowered, compiler_options: dict | None = None):
    """``(compiled, [Launch])``: ``lowered`` (a ``jax.jit(...).lower(...)`` for GPU devices) compiled, with the
    resources of every kernel it launches (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="jaxtrain-launches-") as tmp:
        cache = Path(tmp) / "kernels.bin"
        compiled = lowered.compile(compiler_options={**(compiler_options or {}), "xla_dump_to": tmp,
                                                     "xla_gpu_kernel_cache_file": str(cache)})
        thunks = "".join(p.read_text() for p in Path(tmp).glob("*thunk_sequence.txt"))
        cubins = _cubin_kernels(cache.read_bytes()) if cache.exists() else {}
    text = compiled.as_text()
    triton = set(_TRITON_NAME.findall(text))
    launches = []
    for m in _THUNK.finditer(thunks):
        name, grid, block, dynamic = m.group(1), tuple(map(int, m.group(2, 3, 4))), m.group(5, 6, 7), int(m.group(8))
        regs, static = cubins.get(name, (None, 0))
        launches.append(Launch(name, "triton" if name in triton else "xla", grid,
                               int(block[0]) * int(block[1]) * int(block[2]), dynamic + static, regs))
    launches += [_mosaic_launch(op_name, module) for op_name, module in _MOSAIC.findall(text)]
    return compiled, launches


def _sections(elf: bytes):
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + k * shentsize) for k in range(shnum)]
    names = heads[shstrndx][4]

    def name(h):
        return elf[names + h[0]: elf.index(b"\0", names + h[0])].decode()

    return {name(h): h for h in heads}  # name -> (name, type, flags, addr, offset, size, link, info, align, entsize)


def _cubin_kernels(blob: bytes) -> dict:
    """kernel name -> (registers, static shared bytes), from every cubin (ELF) in XLA's kernel cache file."""
    out = {}
    for start in (m.start() for m in re.finditer(rb"\x7fELF", blob)):
        elf = blob[start:]
        try:
            sections = _sections(elf)
            symtab, strtab, info = sections[".symtab"], sections[".strtab"], sections.get(".nv.info")
        except (struct.error, ValueError, KeyError):
            continue  # not a whole cubin

        def symbol(k):
            o = struct.unpack_from("<I", elf, symtab[4] + 24 * k)[0]
            return elf[strtab[4] + o: elf.index(b"\0", strtab[4] + o)].decode()

        off, end = (info[4], info[4] + info[5]) if info else (0, 0)
        while off < end:
            fmt, attr, value = struct.unpack_from("<BBH", elf, off)
            if fmt == EIFMT_SVAL and attr == EIATTR_REGCOUNT:
                sym, regs = struct.unpack_from("<II", elf, off + 4)
                name = symbol(sym)
                static = sections.get(f".nv.shared.{name}")
                out[name] = (regs, static[5] if static else 0)
            off += 4 + (value if fmt == EIFMT_SVAL else 0)
    return out


def _unescape(hlo_string: str) -> bytes:
    """Bytes of a string as the HLO printer writes it (``\\XX`` hex escapes, ``\\"``, ``\\\\``)."""
    return re.sub(rb"\\([0-9A-Fa-f]{2}|.)", lambda m: bytes([int(m.group(1), 16)]) if len(m.group(1)) == 2
                  else m.group(1), hlo_string.encode("latin-1"), flags=re.DOTALL)


def _mosaic_launch(op_name: str, module: str) -> Launch:
    from jax._src.lib.mlir import ir  # JAX's own MLIR (the module is MLIR bytecode)
    from jax.experimental.mosaic.gpu import dialect  # its types (barriers) must be known to read it

    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        dialect.register_dialect(ctx)
        text = str(ir.Module.parse(_unescape(module)))
    consts = dict(re.findall(r'(%\d+) = "[\w.]*arith\.constant"\(\) \{value = (\d+) : (?:index|i32)\}', text))
    operands = re.search(r'"[\w.]*gpu\.launch"\(([^)]*)\)', text).group(1).split(", ")
    grid, block, smem = operands[-7:-4], operands[-4:-1], operands[-1]  # after the async token: grid, block, smem

    def value(v):
        return int(consts[v])

    return Launch(op_name.split("/")[-2] if "/" in op_name else op_name, "mosaic", tuple(map(value, grid)),
                  value(block[0]) * value(block[1]) * value(block[2]), value(smem), None)


def format_launches(launches: list[Launch], backends=("triton", "mosaic")) -> list[str]:
    """A markdown table of the kernels of ``backends``."""
    lines = ["| kernel | backend | grid | threads | shared memory | registers per thread |",
             "|---|---|---|---|---|---|"]
    for k in launches:
        if k.backend in backends:
            regs = k.registers if k.registers is not None else "at first run"
            lines.append(f"| {k.name} | {k.backend} | {k.grid[0]}x{k.grid[1]}x{k.grid[2]} | {k.threads} | "
                         f"{k.shared_bytes:,} B | {regs} |")
    return lines
