"""The compiled GPU program as data: each computation's instructions (name, result shape, opcode, operands,
attributes), sizes in bytes, the FLOPs of the matmuls and convolutions from their shapes, and the devices of
each collective's replica groups. Read from the scheduled HLO text ``compiled.as_text()`` prints.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
                "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "token": 0}
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+[a-z]*)?)\[([\d,]*)\](\{[^}]*\})?")
HOST_SPACE = ":S(5)"  # in a layout: the array lives in the host's pinned memory (XLA's memory space 5)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_HEAD = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # the result's shape text: "bf16[128,10]{1,0}" or a tuple "(f32[2]{0}, u8[0]{0})"
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    line: str

    def calls(self) -> list[str]:
        """The computations this instruction calls (fusion body, while body/condition, async wrapped...)."""
        names = re.findall(r"\b(?:calls|body|condition|to_apply|branch_computations)=\{?(%[^}\s]+(?:, %[^,}\s]+)*)",
                           self.attrs)
        return [n.strip().lstrip("%") for group in names for n in group.split(",")]


def arrays(shape: str, host: bool | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of each array in a shape text; ``host``: only those in host memory (True) or only
    those in device memory (False)."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims, layout in ARRAY.findall(shape)
            if d in _DTYPE_BYTES and (host is None or (HOST_SPACE in layout) == host)]


def nbytes(shape: str, host: bool | None = None) -> float:
    return sum(_DTYPE_BYTES[d] * math.prod(dims) for d, dims in arrays(shape, host))


def _split_top(text: str) -> tuple[str, str]:
    """``text`` starting with "(": the balanced (...) and what follows it."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[:i + 1], text[i + 1:]
    return text, ""


def parse_instr(line: str) -> Instr | None:
    m = _HEAD.match(line)
    if m is None:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        shape, rest = _split_top(rest)
        rest = rest.lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    args, attrs = _split_top("(" + rest)
    return Instr(m.group(1), shape, opcode, re.findall(r"%([^\s,)]+)", args), attrs.lstrip(", "), line)


def computations(hlo_text: str) -> dict[str, list[Instr]]:
    """Each computation's instructions, in the printed (for the entry: scheduled) order."""
    comps: dict[str, list[Instr]] = {}
    name = None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            name = m.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and (instr := parse_instr(line)):
            comps[name].append(instr)
    return comps


def entry_name(hlo_text: str) -> str:
    m = re.search(r"^ENTRY %(\S+) ", hlo_text, re.MULTILINE)
    if m is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return m.group(1)


def _dims(attr: str, text: str) -> list[int]:
    m = re.search(attr + r"=\{([\d,]*)\}", text)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def dot_flops(instr: Instr, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size, for an HLO ``dot`` (operand shapes looked up by name)."""
    out = arrays(instr.shape)[0][1]
    lhs = arrays(shapes[instr.operands[0]])[0][1]
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in _dims("lhs_contracting_dims", instr.attrs))


def gemm_flops(instr: Instr, shapes: dict[str, str]) -> float:
    """A cuBLAS custom call: its backend_config's dot dimension numbers."""
    out = arrays(instr.shape)[0][1]
    lhs = arrays(shapes[instr.operands[0]])[0][1]
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    contracting = [int(x.strip('"')) for x in m.group(1).split(",") if x] if m else []
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def matmul_flops(hlo_text: str, trips: bool = True) -> float:
    """The FLOPs of a program's dots and convolutions (HLO ``dot`` and ``convolution``, in fusions too; a GPU's
    cuBLAS gemms and cuDNN convolutions; a CPU's oneDNN calls, ``onednn.call_flops``), a
    while loop's body counted its known trip count times (``trips=False``: once, as XLA's cost analysis counts
    it: a scan over a model's layers would be one layer)."""
    from jaxtrain.kernels.onednn import call_flops

    comps = computations(hlo_text)
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}

    def walk(name: str) -> float:
        total = 0.0
        for instr in comps.get(name, ()):
            if instr.opcode == "dot":
                total += dot_flops(instr, shapes)
            elif instr.opcode == "convolution":
                total += conv_flops(instr, shapes)
            elif instr.opcode == "custom-call" and (target := re.search(r'custom_call_target="([^"]+)"',
                                                                         instr.attrs)):
                kind = target.group(1)  # a GPU's cuBLAS gemm or cuDNN convolution; a CPU's oneDNN call
                total += gemm_flops(instr, shapes) if "gemm" in kind else conv_flops(
                    instr, shapes) if "cudnn$conv" in kind else call_flops(instr.line)
            elif instr.opcode == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
                body = re.search(r"body=%([^,\s]+)", instr.attrs).group(1)
                total += walk(body) * (int(n.group(1)) if n and trips else 1)
            else:
                total += sum(walk(c) for c in instr.calls())
        return total

    return walk(entry_name(hlo_text))


def conv_flops(instr: Instr, shapes: dict[str, str]) -> float:
    """A convolution (HLO or cuDNN): 2 x the forward output's elements x (kernel elements / output features).
    Forward: (input, kernel) -> output; backward input: (d_output, kernel) -> d_input; backward filter:
    (input, d_output) -> d_kernel."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
    target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
    kind = target.group(1) if target else "convForward"
    if "BackwardInput" in kind:
        fwd_out, kernel = shapes[instr.operands[0]], shapes[instr.operands[1]]
    elif "BackwardFilter" in kind:
        fwd_out, kernel = shapes[instr.operands[1]], instr.shape
    else:
        fwd_out, kernel = instr.shape, shapes[instr.operands[1]]
    out_dims, kernel_dims = arrays(fwd_out)[0][1], arrays(kernel)[0][1]
    out_features = kernel_dims[labels.group(2).index("o")] if labels else kernel_dims[-1]
    return 2.0 * math.prod(out_dims) * math.prod(kernel_dims) / out_features


def replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The device ids of each replica group, from any way HLO prints them (no groups: all devices)."""
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs):
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return [g for g in groups if g] or [list(range(devices))]
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs):
        axes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
        inside = re.findall(r"'(\w+)'", m.group(2))
        ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes])
        order = [i for i, (a, _) in enumerate(axes) if a not in inside] + \
                [i for i, (a, _) in enumerate(axes) if a in inside]
        size = math.prod(n for a, n in axes if a in inside)
        return ids.transpose(order).reshape(-1, size).tolist()
    return [list(range(devices))]


def kernel_bytes(instr: Instr, comps: dict[str, list[Instr]], shapes: dict[str, str]) -> float:
    """What a kernel reads and writes: its operands and result, except that a fusion updating a buffer in
    place (a dynamic-update-slice root: a scan's stacked outputs) writes only the update, and an operand
    it only slices is read only in those slices (bitcasts looked through)."""
    return sum(_traffic(instr, comps, shapes, None))


# No kernel and no bytes moved: bookkeeping, and the ends of async ops (their starts do the work).
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
               "opt-barrier", "partition-id", "replica-id", "copy-done", "domain"}
ALLOCATION = 'custom_call_target="AllocateBuffer"'  # a buffer made (a loop's stacked outputs): it moves nothing


def host_traffic(instr: Instr, comps: dict[str, list[Instr]], shapes: dict[str, str]) -> tuple[float, float]:
    """(bytes to, bytes from) the host's memory (remat's offloaded values) a non-collective instruction moves:
    a ``copy-start`` between memory spaces (its shape: destination, source, context), or a kernel's reads and
    writes there, counted as ``kernel_bytes`` counts them. A loop or call moves nothing itself (its body does)."""
    if instr.opcode == "copy-start":
        if HOST_SPACE not in instr.shape:
            return 0.0, 0.0
        dest = next(ARRAY.finditer(instr.shape)).group(0)
        return (nbytes(dest), 0.0) if HOST_SPACE in dest else (0.0, nbytes(dest))
    if instr.opcode in (*NOT_KERNELS, "while", "call", "conditional") or ALLOCATION in instr.attrs:
        return 0.0, 0.0
    return _traffic(instr, comps, shapes, True)


def _traffic(instr: Instr, comps, shapes, host: bool | None) -> tuple[float, float]:
    """(bytes written, bytes read) by a kernel, of arrays in ``host`` memory (``arrays``)."""
    out = nbytes(instr.shape, host)
    if instr.opcode == "fusion-start":  # ((operands...), result, context): the result
        result = [m.group(0) for m in ARRAY.finditer(instr.shape)][len(instr.operands):len(instr.operands) + 1]
        out = sum(nbytes(r, host) for r in result)
    reads = [nbytes(shapes.get(o, ""), host) for o in instr.operands]
    body = comps.get(instr.calls()[0], []) if instr.opcode.startswith("fusion") and instr.calls() else []
    named = {i.name: i for i in body}
    params = {i.name: int(re.search(r"parameter\((\d+)\)", i.line).group(1)) for i in body
              if i.opcode == "parameter"}

    def source(name: str) -> str:  # through bitcasts
        while name in named and named[name].opcode == "bitcast":
            name = named[name].operands[0]
        return name

    root = next((i for i in body if i.line.lstrip().startswith("ROOT ")), None)
    if root is not None:
        for r in [named[o] for o in root.operands if o in named] if root.opcode == "tuple" else [root]:
            if r.opcode == "dynamic-update-slice" and source(r.operands[0]) in params:
                reads[params[source(r.operands[0])]] = 0.0  # updated in place
                whole = nbytes(r.shape, host)  # the buffer, if it lives in the memory counted
                out -= whole - (nbytes(shapes[r.operands[1]]) if whole else 0.0)  # only the update is written
        users: dict[str, list] = {}
        for i in body:
            if i.opcode != "bitcast":
                for o in i.operands:
                    users.setdefault(source(o), []).append(i)
        for name, k in params.items():
            use = users.get(name, [])
            if use and all(u.opcode in ("dynamic-slice", "slice") and source(u.operands[0]) == name for u in use):
                reads[k] = min(reads[k], sum(nbytes(u.shape) for u in use))
    return out, sum(reads)
