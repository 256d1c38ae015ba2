"""What a step compiled for a GPU holds, read from XLA's own artefacts (nothing runs, nothing is autotuned).

- memory: ``memory_analysis()`` of the per-GPU program (arguments, outputs, aliased = donation kept, temps);
- FLOPs: XLA's cost analysis of the per-GPU module just after SPMD partitioning, before XLA:GPU rewrites
  convolutions and dots into cuDNN / cuBLAS custom calls (which its cost analysis counts as 0);
- bytes: XLA's cost analysis of the optimised per-GPU module;
- collectives and kernels: the scheduled, optimised HLO text.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

from jaxtrain.analysis import hlo
from jaxtrain.analysis.diagnostics import collective_op

_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|called_computations)="
                     r"\{?([^}\s]+(?:, %[^,}\s]+)*)")
_WHILE = re.compile(r" while\(.*condition=%([^,\s]+), body=%([^,\s]+)")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_FUSION = re.compile(r"^\s*(?:ROOT )?%\S+ = .* fusion\(")


# With no GPU to time on, XLA's autotuner only picks defaults; switched off, a compile takes half the time and
# gives the same memory (ResNet-18: tests/test_gpu_compile.py; the ViT within 0.1%), though some fusions'
# launch configs differ.
AUTOTUNER_OFF = {"xla_gpu_autotune_level": 0}


def _cost(module) -> dict:
    """XLA's HloCostAnalysis of an HloModule, computed by the CPU client (the GPU one here compiles only)."""
    import jax
    from jax._src.lib import _jax  # the module cost analysis has no public API (jax 0.12)

    return _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)


def compile_lowered(lowered, dump_dir: str | None = None) -> tuple:
    """``(compiled, seconds, per-GPU FLOPs, bytes accessed)``: one compile, whose module after SPMD
    partitioning XLA dumps to a temporary directory for its FLOPs (a while loop's later trips' matmuls added:
    ``hlo.matmul_flops``; ``dump_dir``: to this one, emptied first: the
    same options every time, so that JAX's persistent compilation cache can serve the next process; FLOPs are
    None where it did, since nothing compiled)."""
    from jaxlib import _hlo  # parses HLO text (jax 0.12: no public API)

    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)
    with (contextlib.nullcontext(dump_dir) if dump_dir else tempfile.TemporaryDirectory()) as dump:
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump,
                                                     "xla_dump_hlo_pass_re": "spmd-partitioning"})
        seconds = time.perf_counter() - start
        # One GPU: no partitioning pass runs, and the module before optimisation is already per GPU.
        found = (sorted(glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt"))) or
                 sorted(glob.glob(os.path.join(dump, "*before_optimizations.txt"))))
        flops = _cost(_hlo.hlo_module_from_text(open(found[-1]).read())).get("flops") if found else None
    optimised = compiled.runtime_executable().hlo_modules()[0]
    if flops is not None:  # XLA counts a while loop's body once: its later trips' matmuls added
        text = compiled.as_text()
        flops += hlo.matmul_flops(text) - hlo.matmul_flops(text, trips=False)
    return compiled, seconds, flops, _cost(optimised).get("bytes accessed")


COMPILED_KEPT = 64  # entries a folder of compiled programs keeps (the least recently used go first)


def compiled_text(lowered, target, folder: Path | None, where: str = "") -> tuple[str, bool]:
    """``(optimised HLO text, whether it was read from folder)``: ``lowered`` (a step lowered for ``target``'s
    compile-only GPUs; ``where``: how many of them, on how many hosts) compiled, or its text kept in ``folder``
    (None: always compiled) by an earlier compile of the same inputs. An entry is named by the digest of what the
    compile reads: the lowered program, ``where``, the target XLA compiles for (``Target.config_text``),
    ``$XLA_FLAGS``, JAX's compile settings and the versions of jax, jaxlib and the CUDA plugin. The program's
    debug information is not in the digest (its source locations hold the caller's lines), so the text's
    ``op_name`` metadata is the compile's that kept it: the estimate reads only the primitive's name from it, a
    label. (JAX's own persistent cache cannot serve these programs: a GPU executable compiled here cannot be
    loaded back without a GPU.) An unreadable entry is compiled again, and a folder that cannot be written is
    left as it is, each saying so in a warning."""
    import jax

    from jaxtrain import settings
    from jaxtrain.core.compat import installed_version_text

    program = lowered.as_text()
    versions = {name: installed_version_text(name) for name in ("jax", "jaxlib", "jax-cuda12-plugin",
                                                              "jax-cuda12-pjrt", "jax-cuda13-plugin")}
    config = {k: v for k, v in jax.config.values.items() if k in _COMPILE_SETTINGS}
    digest = hashlib.sha256("\0".join([program, where, target.config_text(), settings.xla_flags(), repr(config),
                                        repr(sorted(versions.items()))]).encode()).hexdigest()[:32]
    entry = folder / f"{digest}.hlo.gz" if folder is not None else None
    log = logging.getLogger(__name__)
    if entry is not None and entry.exists():
        try:
            text = gzip.decompress(entry.read_bytes()).decode()
            if "ENTRY" not in text:
                raise ValueError("no ENTRY computation")
            os.utime(entry)  # recently used
            return text, True
        except (OSError, EOFError, UnicodeDecodeError, zlib.error, ValueError) as e:
            log.warning("%s: unreadable (%s): compiling it again", entry, e)
    text = lowered.compile().as_text()
    if entry is not None:
        try:
            _keep(folder, entry, text)
        except OSError as e:
            log.warning("%s: the compiled program could not be kept (%s); the next run compiles it again", folder, e)
    return text, False


# JAX's settings its compiler options are made from (jax._src.compiler): a different value, another program.
_COMPILE_SETTINGS = ("jax_optimization_level", "jax_memory_fitting_level", "jax_disable_most_optimizations",
                     "jax_compiler_enable_remat_pass", "jax_exec_time_optimization_effort",
                     "jax_memory_fitting_effort")


def _keep(folder: Path, entry: Path, text: str) -> None:
    """``text`` as ``entry`` (gzipped, whole or absent), then only the ``COMPILED_KEPT`` most recently used entries
    kept (and no half-written file older than an hour)."""
    folder.mkdir(parents=True, exist_ok=True)
    part = entry.with_suffix(f".part{os.getpid()}")
    with open(part, "wb") as f:
        f.write(gzip.compress(text.encode(), compresslevel=6))
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, entry)
    kept = []
    for path in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):  # another process's pruning got there first
            kept.append((path.stat().st_mtime, path))
    now = time.time()
    stale = [p for t, p in kept if ".part" in p.name and now - t > 3600]
    for path in stale + [p for _, p in sorted(k for k in kept if k[1].name.endswith(".hlo.gz"))[:-COMPILED_KEPT]]:
        path.unlink(missing_ok=True)


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Each computation's instruction lines."""
    return {name: [i.line for i in instrs] for name, instrs in hlo.computations(hlo_text).items()}


def _looped(comps: dict[str, list[str]]) -> set[str]:
    """Computations run inside a while loop: its bodies and conditions, and all they call."""
    todo = [name for lines in comps.values() for line in lines if (m := _WHILE.search(line)) for name in m.groups()]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for group in _CALLED.findall(line):
                todo += [c.strip().lstrip("%") for c in group.split(",")]
    return seen


def collectives(hlo_text: str) -> list[dict]:
    """One entry per kind and placement: ``{"kind", "count", "bytes", "async", "in_loop"}`` (bytes per GPU,
    as ``diagnostics.collective_bytes`` counts them)."""
    comps = _computations(hlo_text)
    looped, out = _looped(comps), {}
    for name, lines in comps.items():
        for line in lines:
            if op := collective_op(line):
                kind, size, started = op
                is_async = started or '"is_sync":false' in line
                entry = out.setdefault((kind, is_async, name in looped),
                                       {"kind": kind, "count": 0, "bytes": 0, "async": is_async,
                                        "in_loop": name in looped})
                entry["count"] += 1
                entry["bytes"] += size
    return sorted(out.values(), key=lambda e: (e["kind"], e["in_loop"], e["async"]))


def kernels(hlo_text: str) -> dict:
    """What the GPU launches: cuDNN calls by kind, cuBLAS gemms, Triton gemm fusions, Pallas (Triton / Mosaic)
    kernels, other custom calls, and the fusion count."""
    calls = Counter(_CUSTOM_CALL.findall(hlo_text))

    def pick(test):  # how many calls of the targets that pass test
        return sum(n for t, n in calls.items() if test(t))

    return {
        "cudnn": {t.split("$", 1)[1]: n for t, n in sorted(calls.items()) if t.startswith("__cudnn$")},
        "cublas_gemms": pick(lambda t: t.startswith("__cublas")),
        "triton_gemm_fusions": len(re.findall(r'"kind":"__triton[a-z_]*gemm[a-z_]*"', hlo_text)),
        "pallas_kernels": pick(lambda t: t in ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")),
        "pallas_backends": {name: n for name, n in (("mosaic", pick(lambda t: t.startswith("mosaic_gpu"))),
                                                     ("triton", pick(lambda t: t == "__gpu$xla.gpu.triton"))) if n},
        "other_custom_calls": {t: n for t, n in sorted(calls.items())
                               if not t.startswith(("__cudnn$", "__cublas", "__gpu$xla.gpu.triton", "mosaic_gpu"))},
        "fusions": sum(1 for line in hlo_text.splitlines() if _FUSION.match(line)),
    }


def memory(compiled) -> dict:
    """Per GPU, bytes: arguments, outputs, aliased (outputs written into donated arguments), temps, and the
    peak a step needs (arguments + outputs + temps - aliased); ``host``: what the step keeps in the host's
    pinned memory (remat's offloaded values), not counted in the total."""
    m = compiled.memory_analysis()
    host = sum(getattr(m, f"host_{k}_size_in_bytes", 0) or 0 for k in ("argument", "output", "temp"))
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temps": m.temp_size_in_bytes,
           "code": m.generated_code_size_in_bytes, "host": host - (getattr(m, "host_alias_size_in_bytes", 0) or 0)}
    out["total"] = out["arguments"] + out["outputs"] + out["temps"] - out["aliased"]
    return out
