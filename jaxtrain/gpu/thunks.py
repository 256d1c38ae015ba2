"""What the host launches of a compiled GPU program, and what runs in command buffers: read without a GPU.

XLA:GPU runs a program as a sequence of thunks: kernels, library calls (cuBLAS, cuDNN), copies, loops. The host
launches each thunk itself, except those recorded in a command buffer (a CUDA graph), which it launches whole.
Which thunks XLA may record is its ``--xla_gpu_enable_command_buffer`` flag, set by JAXTRAIN_COMMAND_BUFFERS
(``compat.COMMAND_BUFFER_FLAGS``). XLA writes the sequence, after its thunk passes, where a compile is dumped
(``xla_dump_to``); this module reads it. The flag is read once per process, so each mode compiles in a child.

A loop (``kWhile``) stays on the host unless the loop itself is inside a command buffer: then its condition is
evaluated and its body launched every trip. Counts here take a loop's condition and body once (one trip).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxtrain import settings
from jaxtrain.core import compat
from jaxtrain.errors import ConfigError

_LINE = re.compile(r"^(\s*)\d+: (k\w+)")
MODES = tuple(compat.COMMAND_BUFFER_FLAGS)


@dataclasses.dataclass
class Thunk:
    kind: str  # kCustomKernel, kConvolution, kWhile, kCommandBuffer, ...
    children: list = dataclasses.field(default_factory=list)


def parse(text: str) -> list[Thunk]:
    """The thunk tree of a dumped thunk sequence: a thunk indented under another is its child (a loop's condition
    and body, a command buffer's thunks, an async start's operation)."""
    root, stack = Thunk("root"), []  # stack: (indent, thunk)
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue  # "condition:", "body:"
        indent, thunk = len(m.group(1)), Thunk(m.group(2))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        (stack[-1][1] if stack else root).children.append(thunk)
        stack.append((indent, thunk))
    return root.children


def _walk(thunks, inside=False):
    for t in thunks:
        yield t, inside
        yield from _walk(t.children, inside or t.kind == "kCommandBuffer")


def host_launches(thunks: list[Thunk]) -> int:
    """What the host launches to run ``thunks`` once (a loop's condition and body once): each thunk without
    children (a kernel, a library call, a copy) outside a command buffer, and each command buffer as one."""
    return sum(1 if t.kind == "kCommandBuffer" else host_launches(t.children) if t.children else 1 for t in thunks)


def summary(thunks: list[Thunk]) -> dict:
    """Command buffers, the thunks inside them, the host's launches (once through each loop), the loops (the
    first one a K-step call's loop over its steps) and how many of them a command buffer holds, and the host's
    launches per trip of the first loop (0 where it is captured)."""
    every = list(_walk(thunks))
    loops = [(t, inside) for t, inside in every if t.kind == "kWhile"]
    first = loops[0] if loops else None
    return {"command_buffers": sum(t.kind == "kCommandBuffer" for t, _ in every),
            "captured": sum(inside and not t.children for t, inside in every),
            "host_launches": host_launches(thunks),
            "loops": len(loops), "loops_captured": sum(inside for _, inside in loops),
            "first_loop_trip": None if first is None else 0 if first[1] else host_launches(first[0].children)}


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


def dumped_thunks(flags: tuple[str, ...], code: str = _CHILD, args: tuple[str, ...] = ()) -> str:
    """The thunk sequence of the largest program ``python -c code *args`` compiles, under ``$XLA_FLAGS`` plus
    ``flags``: after XLA's thunk passes where they ran (command buffers are one), else as emitted."""
    with tempfile.TemporaryDirectory(prefix="jaxtrain-thunks-") as tmp:
        env = {**settings.environment(), "XLA_FLAGS": " ".join([settings.xla_flags(), *flags,
                                                                 f"--xla_dump_to={tmp}"]).strip()}
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise ConfigError(f"compiling for the GPU failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
        texts = {}
        for path in Path(tmp).glob("*thunk_sequence*.txt"):
            module = path.name.split(".thunk_sequence")[0]
            if path.name.endswith("_after_thunk_passes.txt") or module not in texts:
                texts[module] = path.read_text()
    if not texts:
        raise ConfigError("XLA wrote no thunk sequence: is the gpu-compile extra installed (pip install "
                          "'jaxtrain[gpu-compile]')?")
    return max(texts.values(), key=lambda t: len(t.splitlines()))


def command_buffers(settings: dict, steps: int = 1, modes: tuple[str, ...] = MODES, gpu: str = "h100") -> dict:
    """Per JAXTRAIN_COMMAND_BUFFERS mode, ``summary`` of the step a run with ``settings`` (``gpu.plan``'s) trains
    on one ``gpu``, ``steps`` steps a call, compiled in a child under that mode's flag."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ConfigError(f"command buffers {', '.join(unknown)}: use {', '.join(MODES)}")
    kw = json.dumps({"gpu": gpu, "gpus": 1, **settings})
    return {mode: summary(parse(dumped_thunks(compat.gpu_xla_flags(mode), _CHILD, (kw, str(steps)))))
            for mode in modes}
