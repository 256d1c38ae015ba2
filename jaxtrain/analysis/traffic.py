"""What a compiled step moves between devices, read from its HLO text: the collectives by kind and size, and
those whose device groups span processes (what crosses the network on a hybrid mesh)."""

from __future__ import annotations

import math
import re

from jaxtrain.parallel.devices import REPLICA_AXIS

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$")
_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\]")


def _bytes(shape_text: str) -> list[int]:
    """Bytes of each array in an HLO shape, e.g. ``(f32[20]{0}, bf16[3,4]{1,0})`` -> [80, 24]."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        itemsize = 1 if dtype == "pred" else 2 if dtype == "bf16" else int(dtype[1:]) // 8
        out.append(itemsize * math.prod(int(d) for d in dims.split(",") if d))
    return out


def _group_size(attrs: str) -> int:
    """Devices in one replica group, from any of the three ways HLO prints them."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attrs):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=", attrs):
        return int(m.group(1).split(",")[-1])
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return 1


def collective_op(line: str) -> tuple[str, int, bool] | None:
    """``(kind, bytes, async)`` of one compiled-HLO line that starts a collective, else None (see
    ``collective_bytes`` for what ``bytes`` counts; ``async``: a ``-start`` op, its ``-done`` comes later)."""
    m = _OP.match(line)
    if m is None:
        return None
    result, kind, start, attrs = m.groups()
    sizes = _bytes(result)
    if start and kind == "collective-permute":
        return kind, sum(sizes[1:2]), True  # (operand, result, contexts...)
    if start:  # ((operands...), (results...)): the results, the operands of a reduce-scatter
        half = len(sizes) // 2
        return kind, sum(sizes[:half] if kind == "reduce-scatter" else sizes[half:]), True
    return kind, sum(sizes) * (_group_size(attrs) if kind == "reduce-scatter" else 1), False


def collective_bytes(hlo_text: str) -> dict:
    """Per device, per kind: ``{kind: {"ops": count, "bytes": size}}`` of the collectives in compiled HLO text.

    ``bytes`` is the size of the whole buffer each collective works on: the
    result of an all-reduce, all-gather (the gathered array), all-to-all or
    collective-permute, and the INPUT of a reduce-scatter (its result is
    1/n of that). A ring moves about (n-1)/n of it per device for all-gather
    and reduce-scatter, 2(n-1)/n for all-reduce.
    """
    stats: dict = {}
    for line in hlo_text.splitlines():
        if op := collective_op(line):
            entry = stats.setdefault(op[0], {"ops": 0, "bytes": 0})
            entry["ops"] += 1
            entry["bytes"] += op[1]
    return stats


def crossing_bytes(hlo_text: str, hosts) -> dict:
    """``collective_bytes`` of only the collectives whose replica groups span processes: what crosses the
    network. ``hosts[i]``: the process of the i-th device of the mesh (the program's device order); on one
    process, a hybrid mesh's replica index stands for it (``replica_hosts``)."""
    from jaxtrain.analysis.hlo import replica_groups

    stats: dict = {}
    for line in hlo_text.splitlines():
        op = collective_op(line)
        if op and any(len({hosts[d] for d in g}) > 1 for g in replica_groups(line, len(hosts))):
            entry = stats.setdefault(op[0], {"ops": 0, "bytes": 0})
            entry["ops"] += 1
            entry["bytes"] += op[1]
    return stats


def replica_hosts(mesh) -> list[int]:
    """Per device of ``mesh`` (flat order), the process it stands for: its "replica" index (a hybrid mesh);
    the real process index where the mesh spans processes."""
    if len({d.process_index for d in mesh.devices.flat}) > 1 or REPLICA_AXIS not in mesh.axis_names:
        return [d.process_index for d in mesh.devices.flat]
    return [i // (mesh.devices.size // mesh.shape[REPLICA_AXIS]) for i in range(mesh.devices.size)]
