"""The layers hold (docs/architecture.md): which jaxtrain modules may import which, read from the source.

Every import counts, at the top of a file or inside a function: a deferred
import is a dependency all the same.
"""

import ast
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxtrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str, here: str, is_package: bool = False) -> set[str]:
    """The jaxtrain modules a module named ``here`` imports in ``source``, at the top or inside functions
    (``from jaxtrain.models import lenet``: jaxtrain.models.lenet; ``from jaxtrain.models import get``: the package's
    ``__init__``; ``import jaxtrain as jt``, or a name of the face like ``from jaxtrain import Trainer``:
    "jaxtrain", the face). Python runs a package's ``__init__`` before any of its modules: that is no import of
    the ``__init__``'s names, and an ``__init__`` that only re-exports its modules' names closes no circle."""
    found = set()
    package = here if is_package else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & set(MODULES)
            found.update(subs)
            if len(subs) < len(node.names):  # a name the package's __init__ holds, not one of its modules
                found.add(base)
    return {name for name in found if name in MODULES and name != here}


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: imports_in(path.read_text(), name, path.name == "__init__.py") for name, path in MODULES.items()}

# The floors, bottom to top (docs/architecture.md): a module imports from its own floor or the floors below it.
FLOORS = [
    ("ground", ["jaxtrain.errors", "jaxtrain.choices", "jaxtrain.settings", "jaxtrain.version"]),
    ("io", ["jaxtrain.io", "jaxtrain.io.*"]),
    ("core", ["jaxtrain.core", "jaxtrain.core.*"]),
    ("parallel", ["jaxtrain.parallel", "jaxtrain.parallel.*"]),
    ("nn", ["jaxtrain.nn", "jaxtrain.nn.*"]),
    ("kernels", ["jaxtrain.kernels", "jaxtrain.kernels.*"]),
    ("models", ["jaxtrain.models", "jaxtrain.models.*"]),
    ("data", ["jaxtrain.data", "jaxtrain.data.*"]),
    ("pretrained", ["jaxtrain.pretrained", "jaxtrain.pretrained.*"]),
    ("train", ["jaxtrain.train", "jaxtrain.train.*"]),
    ("analysis", ["jaxtrain.analysis", "jaxtrain.analysis.*"]),
    ("driver", ["jaxtrain.driver", "jaxtrain.driver.*"]),
    ("gpu", ["jaxtrain.gpu", "jaxtrain.gpu.*"]),
    ("cli", ["jaxtrain.cli"]),
    ("sweep", ["jaxtrain.sweep", "jaxtrain.sweep.*"]),
    ("slurm", ["jaxtrain.slurm", "jaxtrain.slurm.*"]),
    ("launch", ["jaxtrain.launch"]),
    ("commands", ["jaxtrain.__main__"]),  # the jaxtrain command: each subcommand one of the command lines below
]  # and every package's __main__ (python -m jaxtrain.gpu: jaxtrain gpu-plan) is a command line on the top floor
FACE = "jaxtrain"  # the public names, imported lazily: for users, never for the library itself
# Command lines of their own: their messages are about their flags (the sweep's trials are runs' command lines).
COMMAND_LINES = {"jaxtrain.cli", "jaxtrain.launch", *(m for m in MODULES if m.endswith(".__main__")),
                 *(m for m in MODULES if m.startswith(("jaxtrain.sweep", "jaxtrain.slurm")))}


def matches(name: str, patterns) -> bool:
    return any(name == p or (p.endswith(".*") and name.startswith(p[:-1])) for p in patterns)


def floor(name: str) -> int:
    if name.endswith(".__main__"):  # run, never imported by the library: a command line on the top floor
        return len(FLOORS) - 1
    found = [i for i, (_, patterns) in enumerate(FLOORS) if matches(name, patterns)]
    assert len(found) == 1, f"{name} is on {len(found)} floors: put it in one folder of FLOORS"
    return found[0]


# (who, may never import, why): the nevers stricter than the floors, each one of docs/architecture.md
NEVERS = [
    (["jaxtrain.models", "jaxtrain.models.*"], ["jaxtrain.core.step", "jaxtrain.core.context", "jaxtrain.parallel.*"],
     "a model never knows the mesh, the strategy or the step"),
    (["jaxtrain.kernels.*"], ["jaxtrain.parallel.placement", "jaxtrain.parallel.strategies"],
     "kernels serve models and steps, never the other way round (they may read the step's context)"),
    (["jaxtrain.data", "jaxtrain.data.*"], ["jaxtrain.core.*", "jaxtrain.parallel.*", "jaxtrain.nn.*"],
     "data serves steps, never the other way round: it is handed the plan's batch sharding"),
    (["jaxtrain.driver.report", "jaxtrain.driver.outputs", "jaxtrain.driver.export"],
     ["jaxtrain.core.step", "jaxtrain.parallel.placement", "jaxtrain.parallel.strategies", "jaxtrain.train.trainer",
      "jaxtrain.train.pipeline", "jaxtrain.driver.runner"],
     "a run's files do not depend on how it was trained"),
    ([name for name in MODULES if name not in ("jaxtrain.driver.runner", *COMMAND_LINES)], ["jaxtrain.driver.runner"],
     "the library is usable without the run: only the command lines drive the runner"),
]


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    """Every import in ``graph`` that breaks a rule: up a floor, across a never, or through the face."""
    broken = []
    for name, targets in graph.items():
        for target in sorted(targets):
            if target == FACE:
                if name != FACE:
                    broken.append(f"{name} imports the face (import jaxtrain): import the module itself")
            elif name != FACE and floor(target) > floor(name):
                broken.append(f"{name} imports {target}: up from {FLOORS[floor(name)][0]}/ to "
                              f"{FLOORS[floor(target)][0]}/")
            broken += [f"{name} imports {target}: {why}" for who, forbidden, why in NEVERS
                       if matches(name, who) and matches(target, forbidden)]
    return broken


def test_every_import_goes_down_the_floors_and_across_no_never():
    assert not broken_rules(GRAPH), "\n".join(broken_rules(GRAPH))


def test_a_planted_import_is_caught(monkeypatch):
    """Each kind of broken rule, planted in a copy of the graph, is reported: at the top of a file, inside a
    function, through the face, across a never."""
    plants = {
        "jaxtrain.core.step": ("from jaxtrain.train import trainer\n", "up from core/ to train/"),
        "jaxtrain.parallel.placement": ("def f():\n    from jaxtrain.driver.config import RunConfig\n",
                                        "up from parallel/ to driver/"),
        "jaxtrain.driver.assemble": ("import jaxtrain as jt\n", "imports the face"),
        "jaxtrain.models.lenet": ("from jaxtrain.parallel import devices\n", "never knows the mesh"),
        "jaxtrain.data.loader": ("from jaxtrain import Trainer\n", "imports the face"),
    }
    for name, (source, says) in plants.items():
        planted = {**GRAPH, name: GRAPH[name] | imports_in(source, name)}
        assert any(line.startswith(name) and says in line for line in broken_rules(planted)), (name, says)


def test_the_folders_are_the_layers():
    """At most 6 modules directly in jaxtrain/ (besides Python's own __init__ and __main__); every module on one
    floor; the floors' folders all there."""
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 6, top
    for name in set(MODULES) - {FACE}:
        floor(name)
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == {f for f, patterns in FLOORS if any(p.endswith(".*") for p in patterns)}


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle in ``graph`` (its modules, the first one again at the end), or None."""
    done, path = set(), []

    def visit(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            if found := visit(target):
                return found
        path.pop()
        done.add(name)
        return None

    return next(filter(None, map(visit, sorted(graph))), None)


def test_the_modules_import_each_other_in_no_circle():
    """Following imports never comes back to where it started, a package's own ``__init__`` included."""
    assert circle(GRAPH) is None, "import circle: " + " -> ".join(circle(GRAPH))


def test_a_package_init_only_says_and_re_exports():
    """A registry or any other logic lives in a module of its own: an ``__init__`` is a docstring, imports and
    ``__all__`` (the face and the sweep add a ``__getattr__`` that imports their names on first use)."""
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            lazy = isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")
            said = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            exports = isinstance(node, ast.Assign) and [t.id for t in node.targets] in (["__all__"], ["_EXPORTS"])
            assert isinstance(node, (ast.Import, ast.ImportFrom)) or lazy or said or exports, \
                f"{path.relative_to(ROOT)}:{node.lineno}: move it to a module of the package, re-export it here"


def test_a_module_importing_its_own_packages_init_is_a_circle_the_checker_sees():
    planted = "from jaxtrain.models import get\n"  # the registry asking its package's __init__ for a name of its own
    graph = {**GRAPH, "jaxtrain.models.registry": GRAPH["jaxtrain.models.registry"]
             | imports_in(planted, "jaxtrain.models.registry")}
    assert circle(graph) == ["jaxtrain.models", "jaxtrain.models.registry", "jaxtrain.models"]


def test_the_checker_sees_function_level_imports():
    assert "jaxtrain.nn.int8" in GRAPH["jaxtrain.models.registry"]  # imported inside a builder function
    assert "jaxtrain.models.lenet" in GRAPH["jaxtrain.analysis.quantize"]  # idem
    assert "jaxtrain.io.files" in GRAPH["jaxtrain.train.checkpoint"]
    assert len(MODULES) > 40 and all(GRAPH[m] <= set(MODULES) for m in GRAPH)


def private_names_across_modules(path: Path) -> list[str]:
    """``from jaxtrain.x import _name`` and ``module._name`` of a jaxtrain module ``path`` imported."""
    tree, found, modules = ast.parse(path.read_text()), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxtrain"):
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES:
                    modules.add(a.asname or a.name)
                elif a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__")):
                    found.append(f"{path.name}:{node.lineno}: {node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.asname and a.name in MODULES)
    found += [f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
              and node.attr.startswith("_") and not node.attr.startswith("__")]
    return found


def test_no_private_names_across_modules():
    found = [hit for path in MODULES.values() for hit in private_names_across_modules(path)]
    assert not found, found


# Commands of their own a message shows as the user types them (TFDS's; a training run's, to make a run directory).
OTHER_TOOLS = re.compile(r"tfds build \S+ --file_format|--file_format=array_record"
                         r"|(python -m experiments\.\w+|jaxtrain \w+) --out")


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


# Parameters a command spells its own way (its one_line_errors' flags=), beside every RunConfig setting.
COMMAND_NAMES = ("gpus", "hosts", "memory_fraction", "budget_bytes", "run_dir")


def named_by_hand(path: Path) -> list[str]:
    """Where ``path``'s strings write a parameter as ``name=`` themselves (a setting's or a command's name before
    "=", at the start or after a space, "(" or a quote), not ``errors.named(name, ...)``; docstrings and
    ``__repr__``s (Python's own syntax) aside. (A name
    made at run time, ``f"{name}={value}"``, is not seen: there are few, and each names an environment variable
    or goes through ``named``.)"""
    from jaxtrain.driver.sections import FIELDS

    names = "|".join(sorted([*FIELDS, *COMMAND_NAMES], key=len, reverse=True))
    said = re.compile(r"(?<![^\s(`'\"])(" + names + ")=")
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    docs |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "__repr__"
             for part in ast.walk(node)}
    return [f"{path.name}:{node.lineno}: {m.group(0)}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            for m in said.finditer(node.value)]


def test_library_messages_name_parameters_through_errors_named_and_a_command_line_says_its_flags():
    """A Python user reads ``workers=-1``, a command line ``--workers -1``: each message names a parameter with
    ``errors.named``, which a command's ``library_log`` makes say flags (no message is rewritten after it is
    made); and no library message writes a flag itself (16 modules once did)."""
    from jaxtrain import cli, errors
    from jaxtrain.driver import runner

    leaks = [hit for name, path in MODULES.items() if name not in COMMAND_LINES for hit in flags_in_errors(path)]
    assert not leaks, leaks
    assert flags_in_errors(MODULES["jaxtrain.cli"])  # the check sees flags where they are
    by_hand = [hit for name, path in MODULES.items() if name not in COMMAND_LINES for hit in named_by_hand(path)]
    assert not by_hand, by_hand
    assert named_by_hand(ROOT / "tests" / "test_architecture.py")  # the check sees them where they are: "workers=-1"
    said = ("workers=-1", "checkpoint_dir=", "resume=True", "budget_bytes=", "bogus=1")
    assert (errors.named("workers", -1), errors.named("checkpoint_dir"), errors.named("resume", True),
            errors.named("budget_bytes"), errors.named("bogus", 1)) == said
    with cli.library_log({"budget_bytes": "--memory-budget"}):
        assert (errors.named("workers", -1), errors.named("checkpoint_dir"), errors.named("resume", True),
                errors.named("budget_bytes"), errors.named("bogus", 1)) == (
            "--workers -1", "--checkpoint-dir", "--resume", "--memory-budget", "bogus=1")
    assert errors.named("workers", -1) == "workers=-1"  # after the command: a Python caller's names again
    with cli.library_log({"model": "--student"}), cli.library_log():  # nested: the outer command's spelling
        assert errors.named("model", "x") == "--student x"
        assert errors.named("schedule", "circular", setting="pipeline_schedule") == "--pipeline-schedule circular"
        assert runner.recorded(errors.named, "conv", "xla") == "conv=xla"  # a run's files: Python's names
    assert errors.named("schedule", "circular", setting="pipeline_schedule") == "schedule=circular"


def calls(path: Path, name: str):
    """The calls in ``path`` of a function or class named ``name`` (``x.name(...)`` or ``name(...)``)."""
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == name]


def test_no_context_variable_outside_the_step_and_no_batch_sharding_outside_the_plan():
    """What a model needs reaches it through one object (core/context.py), set by the step; the batch's placement
    is the plan's."""
    contexts = {name for name, path in MODULES.items() if calls(path, "ContextVar") or calls(path, "StepContext")}
    assert contexts == {"jaxtrain.core.context"}, contexts  # and a shard's StepContext is made there only

    def batch_sharding(node) -> bool:  # NamedSharding(mesh, P(DATA_AXIS)), P("data") or P(batch_axes(mesh))
        spec = node.args[1] if len(node.args) > 1 else None
        first = spec.args[0] if isinstance(spec, ast.Call) and spec.args else None
        named = isinstance(first, ast.Call) and getattr(first.func, "id", None) == "batch_axes"
        return named or getattr(first, "id", None) == "DATA_AXIS" or getattr(first, "value", None) == "data"

    placing = {name for name, path in MODULES.items() if any(map(batch_sharding, calls(path, "NamedSharding")))}
    assert placing == {"jaxtrain.parallel.placement"}, placing


# Where the library may write to the terminal itself: the command lines that are only that (their usage and
# errors are their interface), and a module's ``if __name__ == "__main__":`` block.
PRINTERS = {"jaxtrain.cli", "jaxtrain.launch", *(m for m in MODULES if m.endswith("__main__"))}


def writes_to_the_terminal(source: str) -> list[int]:
    """The lines of ``print(...)``, ``sys.stdout.write`` / ``sys.stderr.write`` in ``source`` outside its
    ``if __name__ == "__main__":`` block."""
    tree = ast.parse(source)
    main_blocks = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    skip = {id(n) for block in main_blocks for n in ast.walk(block)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and id(node) not in skip
            and (getattr(node.func, "id", None) == "print"
                 or ast.unparse(node.func) in ("sys.stdout.write", "sys.stderr.write"))]


def test_the_library_logs_and_never_prints():
    """What the library says goes through ``logging`` (a sweep, a notebook or a job routes or silences it;
    ``jaxtrain.io.console`` shows it as lines); only the command lines print."""
    printing = {name: lines for name, path in MODULES.items() if name not in PRINTERS
                if (lines := writes_to_the_terminal(path.read_text()))}
    assert not printing, printing
    assert writes_to_the_terminal("import sys\nprint(1)\nif __name__ == '__main__':\n    print(2)\n") == [2]
    assert writes_to_the_terminal("import sys\ndef f():\n    sys.stderr.write('x')\n") == [3]
    assert writes_to_the_terminal(MODULES["jaxtrain.cli"].read_text())  # the check sees prints where they are


def test_the_environment_is_read_in_settings():
    """Every JAXTRAIN_* variable is a field of jaxtrain.settings, read there once (not while a step is traced)."""
    from jaxtrain import settings

    readers = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc")
               and re.search(r"os\.environ|getenv", p.read_text())}
    assert readers == {"settings.py"}, sorted(readers)
    named = {m for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc") for m in re.findall(r"JAXTRAIN_[A-Z_]+",
                                                                                             p.read_text())}
    assert named <= set(settings.VARIABLES.values()), sorted(named - set(settings.VARIABLES.values()))
    rows = [line for line in (ROOT / "docs" / "settings.md").read_text().splitlines() if line.startswith("| `")]
    assert sorted(row.split("`")[1] for row in rows) == sorted(settings.VARIABLES.values())  # one table, all


def test_every_public_name_and_command_still_answers():
    """The layout is the library's business: ``jt.*``, ``jaxtrain.gpu.*`` and the commands stay where users found
    them (``python -m jaxtrain.cli / .launch / .sweep``, every ``experiments.*``)."""
    import importlib
    import subprocess
    import sys

    import jaxtrain as jt
    from jaxtrain import gpu, sweep

    for name in (m for m in MODULES if not m.endswith("__main__")):  # first: a subpackage named like a public
        # name would shadow it
        importlib.import_module(name)
    for face in (jt, gpu, sweep):
        missing = [n for n in face.__all__ if getattr(face, n, None) is None]
        assert not missing, (face.__name__, missing)
    shadowed = [n for n, home in jt._EXPORTS.items() if getattr(jt, n) is not getattr(importlib.import_module(home), n)]
    assert not shadowed, shadowed  # e.g. jt.run, the function, not a subpackage called run
    for command in ("jaxtrain", "jaxtrain.cli", "jaxtrain.launch", "jaxtrain.sweep", "jaxtrain.slurm", "jaxtrain.gpu"):
        out = subprocess.run([sys.executable, "-m", command, "--help"], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0 and "usage:" in out.stdout, (command, out.stderr[-500:])
    for path in sorted((ROOT / "experiments").glob("*.py")):
        importlib.import_module(f"experiments.{path.stem}")  # each imports what it names


def test_a_frozen_value_is_never_changed_after_it_is_made():
    """No ``object.__setattr__`` in the library: a RunConfig's recipe defaults are resolved before its fields are
    set (``config.with_recipe``), not written into a frozen object afterwards."""
    found = [f"{name}:{node.lineno}" for name, path in MODULES.items() for node in calls(path, "__setattr__")
             if getattr(node.func, "value", None) is not None and getattr(node.func.value, "id", None) == "object"]
    assert not found, found
    assert calls(ROOT / "tools" / "same_programs.py", "compile")  # the finder sees calls written as x.name(...)


def test_the_subsystems_a_run_is_assembled_from_take_their_sections_not_the_whole_config():
    """``assemble`` (model, optimizer, steps) and ``observe`` (the watching hooks) are handed sections of a RunConfig
    (``config.network``, ``config.optim``, ...): their signatures say what they depend on."""
    for name in ("jaxtrain.driver.assemble", "jaxtrain.driver.observe"):
        source = MODULES[name].read_text()
        assert "RunConfig" not in source and "config.py" not in source, name
