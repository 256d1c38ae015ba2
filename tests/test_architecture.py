"""The layers hold (docs/architecture.md): which jaxtrain modules may import which, read from the source.

Every import counts, at the top of a file or inside a function: a deferred
import is a dependency all the same.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxtrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The jaxtrain modules ``path`` imports (``from jaxtrain.models import lenet``: jaxtrain.models.lenet)."""
    found, here = set(), module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    known = set(MODULES)
    return {name for name in found if name in known and name != here}


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
# Command lines of their own: their messages are about their flags (the sweep's trials are runs' command lines).
COMMAND_LINES = {"jaxtrain.cli", "jaxtrain.launch", "jaxtrain.sweep", "jaxtrain.sweep_study", "jaxtrain.sweep_workers",
                 "jaxtrain.trials", "jaxtrain.trial_run"}
GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def matches(name: str, patterns) -> bool:
    return any(name == p or (p.endswith(".*") and name.startswith(p[:-1])) for p in patterns)


# (who, may never import, why): each a "never" of docs/architecture.md
NEVERS = [
    (["jaxtrain.models", "jaxtrain.models.*"],
     ["jaxtrain.devices", "jaxtrain.parallel", "jaxtrain.pipeline", "jaxtrain.step", "jaxtrain.trainer",
      "jaxtrain.placement", "jaxtrain.sharding", "jaxtrain.collectives", "jaxtrain.quantize", "jaxtrain.runner"],
     "a model never knows the mesh, the strategy or the step"),
    (["jaxtrain.loop", "jaxtrain.checkpoint"],
     ["jaxtrain.runner", "jaxtrain.report", "jaxtrain.cli", "jaxtrain.config", "jaxtrain.observe"],
     "the loop and the checkpoints sit below the run: they never reach up into it"),
    ([name for name in MODULES if name not in ("jaxtrain.runner", *COMMAND_LINES)],
     ["jaxtrain.runner", "jaxtrain.cli"],
     "the library is usable without the run: only the command lines drive the runner"),
    (["jaxtrain.files", "jaxtrain.errors", "jaxtrain.choices", "jaxtrain.state", "jaxtrain.integrity",
      "jaxtrain.int8", "jaxtrain.timing", "jaxtrain.signals", "jaxtrain.compat", "jaxtrain.settings"],
     [name for name in MODULES if name not in ("jaxtrain.errors", "jaxtrain.settings")],
     "the ground floor imports nothing of jaxtrain but its error type and its settings"),
    (["jaxtrain.report", "jaxtrain.export"],
     ["jaxtrain.step", "jaxtrain.trainer", "jaxtrain.placement", "jaxtrain.parallel", "jaxtrain.pipeline",
      "jaxtrain.runner"],
     "a run's files do not depend on how it was trained"),
    (["jaxtrain.kernels.*"],
     ["jaxtrain.models", "jaxtrain.models.*", "jaxtrain.trainer", "jaxtrain.placement", "jaxtrain.parallel",
      "jaxtrain.pipeline"],
     "kernels serve models and steps, never the other way round (they may read the step's context)"),
    (["jaxtrain.data.*"],
     ["jaxtrain.models", "jaxtrain.models.*", "jaxtrain.step", "jaxtrain.trainer", "jaxtrain.placement",
      "jaxtrain.parallel", "jaxtrain.pipeline"],
     "data serves steps, never the other way round: it is handed the plan's batch sharding"),
    (["jaxtrain.step"],
     ["jaxtrain.parallel", "jaxtrain.placement", "jaxtrain.trainer", "jaxtrain.sharding", "jaxtrain.devices"],
     "the step is the math of one update: the strategies wrap it, the trainer places it"),
]


@pytest.mark.parametrize("who, forbidden, why", NEVERS, ids=[n[2].split(":")[0] for n in NEVERS])
def test_no_module_imports_across_a_never(who, forbidden, why):
    broken = sorted(f"{name} imports {target}" for name in GRAPH if matches(name, who)
                    for target in GRAPH[name] if matches(target, forbidden) and target != name)
    assert not broken, f"{why}: " + "; ".join(broken)


def test_the_modules_import_each_other_in_no_circle():
    """A module's imports form a tree of floors: following them never comes back to where it started."""
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(GRAPH[name]):
            if not (name.startswith(target + ".") or target == "jaxtrain"):  # a package's own __init__
                visit(target)
        path.pop()
        done.add(name)

    for name in MODULES:
        visit(name)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The rules read every import: at the top, inside functions, relative ones."""
    assert "jaxtrain.int8" in GRAPH["jaxtrain.models"]  # imported inside a builder function
    assert "jaxtrain.models.lenet" in GRAPH["jaxtrain.quantize"]  # idem
    assert "jaxtrain.files" in GRAPH["jaxtrain.checkpoint"]
    assert len(MODULES) > 40 and all(GRAPH[m] <= set(MODULES) for m in GRAPH)


OTHER_TOOLS = re.compile(r"tfds build \S+ --file_format|--file_format=array_record|python -m experiments\.\w+ --out")


def flags_in_errors(path: Path) -> list[str]:
    """The ``--flag``s written into the messages of the ConfigErrors ``path`` raises."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")).endswith("Error"):
            text = "".join(part.value for arg in node.args for part in ast.walk(arg)
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            found += [f"{path.name}:{node.lineno}: {flag}"
                      for flag in re.findall(r"--[a-z][\w-]*", OTHER_TOOLS.sub("", text))]
    return found


def test_library_errors_name_parameters_and_the_command_line_says_them_as_flags():
    """A Python user reads ``workers=``, not ``--workers`` (16 modules said flags); the CLI translates."""
    from jaxtrain.cli import as_flags

    leaks = [hit for name, path in MODULES.items() if name not in COMMAND_LINES for hit in flags_in_errors(path)]
    assert not leaks, leaks
    assert flags_in_errors(MODULES["jaxtrain.cli"])  # the check sees flags where they are
    assert as_flags("workers=-1: must be >= 0") == "--workers -1: must be >= 0"
    assert as_flags("pass checkpoint_dir= elsewhere, or resume=True.") == (
        "pass --checkpoint-dir elsewhere, or --resume.")
    assert as_flags("(e.g. data=2,model=2); budget_bytes=", {"budget_bytes": "--memory-budget"}) == (
        "(e.g. data=2,model=2); --memory-budget")


def calls(path: Path, name: str):
    """The calls in ``path`` of a function or class named ``name`` (``x.name(...)`` or ``name(...)``)."""
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == name]


def test_no_context_variable_outside_the_step_and_no_batch_sharding_outside_the_plan():
    """What a model needs reaches it through one object set in step.py; the batch's placement is the plan's."""
    contexts = {name for name, path in MODULES.items() if calls(path, "ContextVar")}
    assert contexts == {"jaxtrain.step"}, contexts

    def batch_sharding(node) -> bool:  # NamedSharding(mesh, P(DATA_AXIS)), P("data") or P(batch_axes(mesh))
        spec = node.args[1] if len(node.args) > 1 else None
        first = spec.args[0] if isinstance(spec, ast.Call) and spec.args else None
        named = isinstance(first, ast.Call) and getattr(first.func, "id", None) == "batch_axes"
        return named or getattr(first, "id", None) == "DATA_AXIS" or getattr(first, "value", None) == "data"

    placing = {name for name, path in MODULES.items() if any(map(batch_sharding, calls(path, "NamedSharding")))}
    assert placing == {"jaxtrain.placement"}, placing


# Still reading the environment themselves (issue 52): the trackers' own variables (MLflow's, W&B's) and a sweep
# trial's child environment.
READS_ITS_OWN = {"track.py", "sweep.py", "trials.py", "trial_run.py"}


def test_the_environment_is_read_in_settings():
    """Every JAXTRAIN_* variable is a field of jaxtrain.settings, read there once (not while a step is traced)."""
    from jaxtrain import settings

    readers = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc")
               and re.search(r"os\.environ|getenv", p.read_text())}
    assert readers - {"settings.py"} <= READS_ITS_OWN, sorted(readers - {"settings.py"} - READS_ITS_OWN)
    named = {m for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc") for m in re.findall(r"JAXTRAIN_[A-Z_]+",
                                                                                             p.read_text())}
    assert named <= set(settings.VARIABLES.values()), sorted(named - set(settings.VARIABLES.values()))
    rows = [line for line in (ROOT / "docs" / "settings.md").read_text().splitlines() if line.startswith("| `")]
    assert sorted(row.split("`")[1] for row in rows) == sorted(settings.VARIABLES.values())  # one table, all
