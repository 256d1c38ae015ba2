"""What the host launches of a compiled GPU program, and what runs in command buffers: read without a GPU.

XLA:GPU runs a program as a sequence of thunks: kernels, library calls (cuBLAS, cuDNN), copies, loops. The host
launches each thunk itself, except those recorded in a command buffer (a CUDA graph), which it launches whole.
Which thunks XLA may record is its ``--xla_gpu_enable_command_buffer`` flag, set by JAXTRAIN_COMMAND_BUFFERS
(``compat.COMMAND_BUFFER_FLAGS``). Where a compile is dumped (``xla_dump_to``), XLA writes the sequence after its
thunk passes, each thunk's HLO name, and the optimized HLO; this module reads them. The flag is read once per
process, so each mode compiles in a child.

A loop (``kWhile``) outside a command buffer is run by the host: a loop with a known trip count (every loop of a
jaxtrain step: ``lax.scan``) launches its body that many times and never its condition; another evaluates its
condition on the device and reads it back before every trip.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxtrain import settings
from jaxtrain.core import compat
from jaxtrain.errors import ConfigError

log = logging.getLogger(__name__)
_LINE = re.compile(r"^(\s*)(\d+): (k\w+)")
_SECTION = re.compile(r"^\s*(condition|body|\w*branch\w*):\s*$")  # a loop's, a conditional's (false_branch, ...)
_WHILE_NAME = re.compile(r'profile_annotation: "([^"]+)"\s*thunk_id: (\d+)\s*}\s*thunk_kind: "kWhile"')
_TRIPS = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*\bwhile\(.*"known_trip_count":\{"n":"(\d+)"\}', re.MULTILINE)
_FLAG = re.compile(r"--xla_gpu_enable_command_buffer=\S*")
MODES = tuple(compat.COMMAND_BUFFER_FLAGS)


@dataclasses.dataclass
class Thunk:
    kind: str  # kCustomKernel, kConvolution, kWhile, kCommandBuffer, ...
    id: int | None = None  # its number in the dump (kCommandBuffer: 0)
    section: str | None = None  # under a loop: "condition" or "body"; under a conditional: its branch
    trips: int | None = None  # a loop's known trip count
    children: list = dataclasses.field(default_factory=list)


def parse(text: str, trips: dict[int, int] | None = None) -> list[Thunk]:
    """The thunk tree of a dumped thunk sequence: a thunk indented under another is its child (a loop's condition
    and body, a conditional's branches, a command buffer's thunks, an async start's operation), labelled with the
    section it is under; ``trips``: loops' known trip counts by id."""
    root, stack, reading = Thunk("root"), [], {}  # stack: (indent, thunk); reading: the section being read
    for line in text.splitlines():
        if m := _SECTION.match(line):  # the label comes right after its thunk, or after the last section's thunks
            holder = next((t for _, t in reversed(stack) if t.kind in ("kWhile", "kConditional")), None)
            if holder is not None:
                reading[id(holder)] = m.group(1)
            continue
        m = _LINE.match(line)
        if not m:
            continue
        indent, thunk = len(m.group(1)), Thunk(m.group(3), int(m.group(2)))
        if thunk.kind == "kWhile":
            thunk.trips = (trips or {}).get(thunk.id)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else root
        thunk.section = reading.get(id(parent))
        parent.children.append(thunk)
        stack.append((indent, thunk))
    return root.children


def trip_counts(metadata: str, hlo: str) -> dict[int, int]:
    """Known trip counts by loop thunk id: the thunk's HLO name (``thunk_metadata``) -> its ``while`` in the
    optimized HLO (``known_trip_count``)."""
    known = dict((name, int(n)) for name, n in _TRIPS.findall(hlo))
    return {int(i): known[name] for name, i in _WHILE_NAME.findall(metadata) if name in known}


def launches(thunks: list[Thunk]) -> int:
    """What the host launches to run ``thunks``: each thunk without children (a kernel, a library call, a copy)
    outside a command buffer, each command buffer as one; a loop's body times its trip count (its condition never
    runs then), or its condition and body once where the count is not known; a conditional's largest branch."""
    n = 0
    for t in thunks:
        if t.kind == "kCommandBuffer" or not t.children:
            n += 1
        elif t.kind == "kWhile":
            n += t.trips * launches(_body(t)) if t.trips is not None else launches(t.children)
        elif t.kind == "kConditional":  # one branch runs: the largest
            branches = {}
            for c in t.children:
                branches.setdefault(c.section, []).append(c)
            n += max(launches(b) for b in branches.values())
        else:
            n += launches(t.children)
    return n


def _body(loop: Thunk) -> list[Thunk]:
    return [c for c in loop.children if c.section == "body"]


def _walk(thunks, inside=False):
    for t in thunks:
        yield t, inside
        yield from _walk(t.children, inside or t.kind == "kCommandBuffer")


def summary(thunks: list[Thunk], steps: int = 1) -> dict:
    """Command buffers and the thunks inside them; what the host launches for one call (``launches``); the
    loops, and how many a command buffer holds; and for a call of ``steps`` > 1 steps, its loop over them (the
    first loop): whether a command buffer holds it, and what the host launches each trip (0 if held)."""
    every = list(_walk(thunks))
    loops = [(t, inside) for t, inside in every if t.kind == "kWhile"]
    # the loop over the steps: the first of ``steps`` trips (lax.scan's count is known), else the first
    steps_loop = next((x for x in loops if x[0].trips == steps), loops[0]) if steps > 1 and loops else None
    return {"command_buffers": sum(t.kind == "kCommandBuffer" for t, _ in every),
            "captured": sum(inside and not t.children for t, inside in every),
            "host_launches": launches(thunks),
            "loops": len(loops), "loops_captured": sum(inside for _, inside in loops),
            "loops_of_unknown_trips": sum(t.trips is None for t, _ in loops),
            "steps_loop_captured": None if steps_loop is None else steps_loop[1],
            "steps_loop_trip": None if steps_loop is None else
            0 if steps_loop[1] else launches(_body(steps_loop[0]))}


@dataclasses.dataclass(frozen=True)
class Dump:
    """One compiled module's dump: its thunk sequence (after the thunk passes where they ran), its thunks' HLO
    names, its optimized HLO, and the command-buffer types its debug options list: those that differ from XLA's
    defaults, so None for XLA's defaults and for an empty list alike."""

    thunks: str
    metadata: str
    hlo: str
    types: tuple[str, ...] | None

    def tree(self) -> list[Thunk]:
        return parse(self.thunks, trip_counts(self.metadata, self.hlo))


def dumped(flags: tuple[str, ...], code: str, args: tuple[str, ...] = ()) -> Dump:
    """The dump of the largest program ``python -c code *args`` compiles, under ``$XLA_FLAGS`` (less any
    command-buffer flag of its own, said in one line) plus ``flags``."""
    given = settings.xla_flags()
    if _FLAG.search(given):
        log.warning("left out of this compile: %s from $XLA_FLAGS (each mode's own flag is compared)",
                    " ".join(_FLAG.findall(given)))
    with tempfile.TemporaryDirectory(prefix="jaxtrain-thunks-") as tmp:
        env = {**settings.environment(),
               "XLA_FLAGS": " ".join([*_FLAG.sub("", given).split(), *flags, f"--xla_dump_to={tmp}"])}
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
            raise ConfigError(last.removeprefix("jaxtrain.errors.ConfigError: ") if "ConfigError: " in last
                              else f"compiling for the GPU failed: {last}")
        modules = {}
        for path in Path(tmp).glob("*thunk_sequence*.txt"):
            module = path.name.split(".thunk_sequence")[0]
            if path.name.endswith("_after_thunk_passes.txt") or module not in modules:
                modules[module] = path.read_text()
        if not modules:
            raise ConfigError("XLA wrote no thunk sequence: is the gpu-compile extra installed (pip install "
                              "'jaxtrain[gpu-compile]')?")
        module = max(modules, key=lambda m: len(modules[m].splitlines()))

        def read(pattern: str) -> str:
            return "".join(p.read_text() for p in Path(tmp).glob(f"{module}.{pattern}"))

        types = re.findall(r"xla_gpu_enable_command_buffer: (\w+)", read("debug_options"))
        return Dump(modules[module], read("thunk_metadata.txt"), read("*gpu_after_optimizations.txt"),
                    tuple(types) or None)


# Compiled in a child: the run's step (K steps a call where K > 1) for compile-only GPUs, XLA_FLAGS as given.
_CHILD = """
import json, sys
import jax
from jaxtrain.gpu import analysis
from jaxtrain.gpu.plan import lowered_step
kw, steps = json.loads(sys.argv[1]), int(sys.argv[2])
s = lowered_step(**kw)
lowered = s.lowered
if steps > 1:
    shapes = s.model.batch_shapes(s.call)
    lowered = s.trainer.lower_steps(s.state, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((steps, *x.shape), x.dtype), shapes))
lowered.compile(compiler_options=analysis.AUTOTUNER_OFF)
"""


def command_buffers(step_settings: dict, steps: int = 1, modes: tuple[str, ...] = MODES, gpu: str = "h100") -> dict:
    """Per JAXTRAIN_COMMAND_BUFFERS mode, ``summary`` of the step a run with ``step_settings`` (``gpu.plan``'s) trains
    on one ``gpu``, ``steps`` steps a call, compiled in a child under that mode's flag, with the command-buffer
    types XLA took (``types``: None for its defaults)."""
    from jaxtrain.gpu.plan import check_settings
    from jaxtrain.gpu.targets import target

    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ConfigError(f"command buffers {', '.join(unknown)}: use {', '.join(MODES)}")
    check_settings(step_settings)
    target(gpu)  # a ConfigError naming the GPUs there are
    untested = [m for m in modes if compat.command_buffers_untested(m)]
    if untested:
        raise ConfigError(f"jaxlib {compat.installed_version_text('jaxlib')} is not one whose command-buffer flag "
                          f"forms are known to parse (tested: {compat.COMMAND_BUFFER_TESTED}): its "
                          f"{', '.join(untested)} would compile as xla")
    kw = json.dumps({"gpu": gpu, "gpus": 1, **step_settings})
    result = {}
    for mode in modes:
        dump = dumped(compat.gpu_xla_flags(mode), _CHILD, (kw, str(steps)))
        result[mode] = {**summary(dump.tree(), steps), "types": dump.types}
    return result
