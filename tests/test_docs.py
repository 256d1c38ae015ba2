"""The docs against the code behind their figures and commands, so that the pages cannot drift from them.

- A table that quotes a benchmark's figures carries ``<!-- checked: experiments.NAME -->`` on the line before it.
  Each such table is regenerated here by that benchmark's own code where its figures are deterministic (no
  clock, no CPU in them), and every copy of it, on any page, must be the same table. A marker naming a command
  with no checker below fails: a marker is a promise that the table is checked.
- Every ``--flag`` of an ``experiments.NAME`` (or ``jaxtrain.sweep`` / ``jaxtrain.launch``) command quoted in
  README.md and docs/*.md is a flag that command's ``--help`` lists.
- No test counts or test-suite durations in the docs: they go stale with every test added (the CI log has them).

Measured timings cannot be compared with a page (they depend on the machine); those tables name their command
beside them (the docs' standard), which a reader re-runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- checked: (?P<command>[^>]*?) -->$")


@dataclasses.dataclass
class Table:
    """A markdown table under a ``checked`` marker: its lines and, per row, its cells."""

    page: Path
    command: str
    line: int  # 1-based, the marker's
    lines: list[str]  # header, separator, rows

    @property
    def rows(self) -> list[list[str]]:
        return [[c.strip() for c in line.strip().strip("|").split("|")] for line in self.lines[2:]]

    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def checked_tables(pages=PAGES) -> list[Table]:
    """Every table under a ``<!-- checked: COMMAND -->`` marker (the table starts on the next line)."""
    tables = []
    for page in pages:
        lines = _text(page).splitlines()
        for i, line in enumerate(lines):
            m = MARKER.match(line.strip())
            if not m:
                continue
            body = []
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                body.append(row)
            assert len(body) >= 3, f"{_name(page)}:{i + 1}: a checked marker must stand right above a table"
            tables.append(Table(page, m["command"], i + 1, body))
    return tables


# ------------------------------------------------------------------------------ experiments.gpu_validate


def _validation_rows(table: Table) -> list[dict]:
    """The rows as ``gpu_validate.rows`` returns them, from the page's estimates and labels; the published figures,
    the ratios and which row is fitted come from the benchmark itself."""
    from experiments import gpu_validate as v

    out = []
    for cells in table.rows:
        assert len(cells) == 8, f"{table.where()}: {cells}"
        gpu, gpus, precision, batch, estimate, _published, _ratio, label = cells
        cell = (gpu.lower(), gpus, precision, batch)
        key = next((k for k in v.PUBLISHED if (k[0], str(k[1]), k[4], str(k[3])) == cell), None)
        assert key is not None, f"{table.where()}: no published cell {cells[:4]} in experiments.gpu_validate"
        m = re.fullmatch(r"(?:held out|fitted); (\w+)-bound(?:; ([\d.]+)% of the step waits for collectives)?", label)
        assert m, f"{table.where()}: the row label {label!r} is not gpu_validate's"
        figure = float(estimate.replace(",", ""))
        out.append({"gpu": key[0], "gpus": key[1], "precision": key[4], "batch_per_gpu": key[3], "estimate": figure,
                    "published": v.PUBLISHED[key], "ratio": figure / v.PUBLISHED[key], "held_out": key != v.FIT_ON,
                    "bottleneck": m[1], "exposed_share": float(m[2] or 0) / 100})
    keys = sorted((r["gpu"], r["gpus"], r["precision"]) for r in out)
    assert keys == sorted((k[0], k[1], k[4]) for k in v.PUBLISHED), f"{table.where()}: not one row per published cell"
    return out


def _bold_bullets_after(table: Table) -> list[str]:
    """The bold openings of the bullets between the table and the next heading (the page's account of its rows)."""
    lines = _text(table.page).splitlines()[table.line + len(table.lines):]
    section = "\n".join(lines[:next((i for i, line in enumerate(lines) if line.startswith("#")), len(lines))])
    return re.findall(r"^- \*\*(.+?)\*\*", section, re.MULTILINE | re.DOTALL)


def check_gpu_validate(table: Table):
    """The table is what ``gpu_validate.format_rows`` prints for its estimates; the ratios its prose quotes are
    the table's; its claim "within 1.5x" holds."""
    from experiments import gpu_validate as v

    rows = _validation_rows(table)
    assert v.format_rows(rows).splitlines() == table.lines, (
        f"{table.where()}: the table differs from what experiments.gpu_validate prints for these estimates:\n"
        + v.format_rows(rows))
    for bullet in _bold_bullets_after(table):
        gpus = {r["gpu"] for r in rows if r["gpu"].upper() in bullet}
        named = {r["precision"] for r in rows if re.search(rf"\b{r['precision']}\b", bullet)}
        mine = [r for r in rows if r["gpu"] in gpus and (not named or r["precision"] in named)]
        rows_named = ", ".join(f"{r['gpu']} x{r['gpus']} {r['precision']}" for r in mine)
        for quoted in re.findall(r"(?<![\d.])\d+\.\d\d(?![\d.])", bullet):  # 1.35, 1.35x, 1.20-1.46
            assert quoted in {f"{r['ratio']:.2f}" for r in mine}, (
                f"{table.where()}: the bullet **{bullet}** quotes {quoted}, a ratio none of its rows "
                f"({rows_named}) has")
    if "within 1.5x" in _text(table.page):
        assert all(1 / 1.5 <= r["ratio"] <= 1.5 for r in rows), f"{table.where()}: a ratio beyond the 1.5x it claims"


# ------------------------------------------------------------------------------ experiments.bench_gpu_plans

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number.replace(",", "")) * UNITS[unit]


def _plan_of(cells: list[str]):
    """A stand-in for the ``jaxtrain.gpu.plan`` a row of bench_gpu_plans came from, rebuilt from the row: the
    benchmark's ``row()`` must print the row back."""
    from types import SimpleNamespace

    model, gpus, batch, memory, largest, gflop, collectives, step, compiled = cells
    gpus, batch = int(gpus), int(batch.replace(",", ""))
    m = re.fullmatch(r"(>= )?([\d,]+) \(([\d,]+)\)", largest)
    assert m, largest
    total = int(m[2].replace(",", ""))
    kinds = [] if collectives == "none" else [
        {"kind": k, "count": int(n), "bytes": _bytes(b)}
        for n, k, b in re.findall(r"(\d+) ([\w-]+) \(([^)]+)\)", collectives)]
    rate = float(re.fullmatch(r"[\d.,]+ ms \(([\d,]+)/s\)", step)[1].replace(",", ""))
    return SimpleNamespace(settings={"model": model}, gpus=gpus, hosts=1, call_batch=batch,
                           per_gpu_batch=batch // gpus, memory={"total": _bytes(memory)}, largest_batch=total,
                           max_batch=total if m[1] else total + 1, flops=float(gflop) * 1e9, collectives=kinds,
                           estimate={"seconds": batch / rate, "examples_per_second": rate},
                           compile_seconds=float(compiled.removesuffix(" s")))


def check_bench_gpu_plans(table: Table):
    """Each row is what ``bench_gpu_plans.row`` prints for its figures: the step time agrees with the examples/s,
    the largest batch per GPU with the largest batch."""
    from experiments import bench_gpu_plans

    for cells, line in zip(table.rows, table.lines[2:], strict=True):
        assert bench_gpu_plans.row(_plan_of(cells)) == line, (
            f"{table.where()}: {line}\n  bench_gpu_plans.row() gives for its figures:\n"
            f"{bench_gpu_plans.row(_plan_of(cells))}")


def check_gpu_offload(table: Table):
    """Its rows without remat are the same plans as bench_gpu_plans' 1-GPU rows: the same figures."""
    plans = {row[0]: row for t in checked_tables() if t.command == "experiments.bench_gpu_plans" for row in t.rows
             if row[1] == "1"}
    none = [row for row in table.rows if row[1] == "none"]
    assert none, f"{table.where()}: no row without remat"
    for model, _, memory, _, _, largest, step in none:
        plan = plans.get(model)
        assert plan, f"{table.where()}: {model} has no 1-GPU row in bench_gpu_plans' table"
        assert (memory, largest, step) == (plan[3], re.search(r"\(([\d,]+)\)", plan[4])[1], plan[7].split(" (")[0]), (
            f"{table.where()}: {model} without remat differs from bench_gpu_plans' 1-GPU row {plan}")


CHECKERS = {"experiments.gpu_validate": check_gpu_validate, "experiments.bench_gpu_plans": check_bench_gpu_plans,
            "experiments.gpu_offload": check_gpu_offload}


def test_every_checked_table_has_a_checker_and_each_command_one_table():
    tables = checked_tables()
    assert tables, "no <!-- checked: ... --> table found: the docs check checks nothing"
    for t in tables:
        assert t.command in CHECKERS, f"{t.where()}: no checker for {t.command!r} in tests/test_docs.py"
    for command in {t.command for t in tables}:
        copies = [t for t in tables if t.command == command]
        assert all(t.lines == copies[0].lines for t in copies), (
            f"the tables of {command} differ: {', '.join(t.where() for t in copies)}")


@pytest.mark.parametrize("table", checked_tables(), ids=lambda t: t.where())
def test_a_checked_table_is_what_its_benchmark_gives(table):
    CHECKERS[table.command](table)


def test_a_misquoted_ratio_or_a_wrong_row_fails_the_check(tmp_path):
    """The checker is not vacuous: a ratio that is not the table's, in the prose or in a row, is caught."""
    explained = [t for t in checked_tables() if t.command == "experiments.gpu_validate" and _bold_bullets_after(t)]
    assert explained, "no page explains the validation table's rows in bold bullets any more"
    text = _text(explained[0].page)
    check_gpu_validate(explained[0])  # as it stands, it passes
    quoted = re.search(r"^- \*\*\w+ \w+[^*]*?(\d\.\d\d)", text, re.MULTILINE)
    for broken in (text[:quoted.start(1)] + "0.01" + text[quoted.end(1):],
                   re.sub(r"\| (\d\.\d\d) \| held out", "| 9.99 | held out", text, count=1)):
        (tmp_path / "p.md").write_text(broken)
        (table,) = [t for t in checked_tables([tmp_path / "p.md"]) if t.command == "experiments.gpu_validate"]
        with pytest.raises(AssertionError):
            check_gpu_validate(table)


@pytest.mark.parametrize("command, cell, wrong", [("experiments.bench_gpu_plans", 7, "9.99 ms (2,930,343/s)"),
                                                   ("experiments.bench_gpu_plans", 4, "933,544 (1,000)"),
                                                   ("experiments.gpu_offload", 2, "1.00 MiB")])
def test_a_plan_figure_changed_in_one_place_fails_the_check(command, cell, wrong):
    table = next(t for t in checked_tables() if t.command == command)
    CHECKERS[command](table)  # as it stands, it passes
    i, row = next((i, r) for i, r in enumerate(table.rows) if r[1] in ("1", "none"))  # a 1-GPU row, no remat
    row[cell] = wrong
    lines = list(table.lines)
    lines[2 + i] = "| " + " | ".join(row) + " |"
    broken = dataclasses.replace(table, lines=lines)
    with pytest.raises(AssertionError):
        CHECKERS[command](broken)


# ------------------------------------------------------------------------------ the commands the pages quote

COMMAND = re.compile(r"(?:python -m )?\b((?:experiments\.[a-z_0-9]+)|jaxtrain\.sweep|jaxtrain\.launch)\b")


def _help(module: str) -> str:
    """What ``python -m MODULE --help`` prints, in-process."""
    from jaxtrain import cli

    mod = importlib.import_module(module)
    entry = getattr(mod, "run", None) or mod.main  # experiments.distill: run() maps --student first
    if entry is cli.main:  # experiments.lenet, resnet18, vit: RunConfig's flags
        return cli.make_parser(module.split(".")[-1]).format_help()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        entry(["--help"])
    return out.getvalue()


def _code(page: Path) -> list[str]:
    """The page's code: each command line of its code blocks (continuations joined) and each inline code span."""
    fragments, prose, block = [], [], None
    for line in _text(page).splitlines():
        if line.lstrip().startswith("```"):  # a fence opens or closes a block
            if block is not None:
                fragments += block
            block = [] if block is None else None
            continue
        if block is None and not line.startswith("    "):
            prose.append(line)
            continue
        command = line.split(" #")[0].rstrip()
        target = block if block is not None else fragments
        if target and target[-1].endswith("\\"):
            target[-1] = target[-1][:-1] + " " + command.strip()
        elif target and command.lstrip().startswith(("[", "--")) and line.startswith("     "):  # an indented tail
            target[-1] += " " + command.strip()
        else:
            target.append(command)
    fragments += re.findall(r"`([^`]+)`", "\n".join(prose).replace("``", ""))
    return fragments


def quoted_flags(page: Path) -> list[tuple[str, str]]:
    """(module, --flag) for every flag the page gives a command it quotes."""
    found = []
    for fragment in _code(page):
        fragment = fragment.replace("\n", " ")
        starts = list(COMMAND.finditer(fragment))
        for i, m in enumerate(starts):
            end = starts[i + 1].start() if i + 1 < len(starts) else len(fragment)
            args = re.split(r" -- | && |; ", fragment[m.end():end])[0]
            found += [(m[1], f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args)]
    return found


# Flags a command takes that its --help does not list: experiments.distill's run() renames --student to --model.
UNLISTED = {"experiments.distill": {"--student"}}


def test_every_quoted_flag_is_one_its_command_has():
    helps, wrong = {}, []
    for page in PAGES:
        for module, flag in quoted_flags(page):
            if module not in helps:
                helps[module] = set(re.findall(r"--[a-z][a-z0-9-]*", _help(module))) | UNLISTED.get(module, set())
            if flag not in helps[module]:
                wrong.append(f"{page.relative_to(ROOT)}: {module} {flag}")
    assert not wrong, "flags the commands do not have (see each one's --help):\n" + "\n".join(wrong)


def test_the_flag_check_reads_code_blocks_and_spans(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Run `python -m experiments.bench --model lenet\n--no-such-flag`.\n\n```sh\n"
                    "python -m jaxtrain.sweep --trials 2 \\\n"
                    "    --nope 1 -- python -m experiments.lenet --devices 2\n```\n")
    assert sorted(quoted_flags(page)) == [("experiments.bench", "--model"), ("experiments.bench", "--no-such-flag"),
                                          ("experiments.lenet", "--devices"), ("jaxtrain.sweep", "--nope"),
                                          ("jaxtrain.sweep", "--trials")]


# ------------------------------------------------------------------------------ the run's result line

RESULT_LINE = re.compile(r"test acc \d\.\d\d, \d+\.\d sec/epoch on \d+ devices? \((?:cpu|gpu)\)")  # jaxtrain.runner


def test_the_example_result_lines_are_the_same_and_the_results_pages():
    """``make demo``'s result line, wherever a page shows it: as the run prints it (``jaxtrain/runner.py``), and the
    2-device row of docs/results.md."""
    shown = {(_name(page), line) for page in PAGES
             for line in re.findall(r"`(test acc [^`]*sec/epoch[^`]*)`", _text(page))}
    assert len(shown) >= 2, shown
    assert all(RESULT_LINE.fullmatch(line) for _, line in shown), shown
    ((acc, sec),) = re.findall(r"^\| jaxtrain, 2 CPU devices \| ([\d.]+) \| ([\d.]+) \|$",
                               _text(ROOT / "docs/results.md"), re.MULTILINE)
    result = f"test acc {float(acc):.2f}, {float(sec):.1f} sec/epoch on 2 devices (cpu)"
    assert {line for _, line in shown} == {result}, shown


# ------------------------------------------------------------------------------ what does not belong in docs

COUNTS = re.compile(r"\b\d[\d,]* (?:passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b"
                    r"|\b\d[\d,]* tests (?:collected|ran|run)\b")


def test_no_test_counts_or_suite_durations_in_the_docs():
    found = [f"{page.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for page in PAGES
             for i, line in enumerate(_text(page).splitlines(), 1) if COUNTS.search(line)]
    assert not found, "test counts (and the suite's durations beside them) go stale; the CI log has them:\n" + (
        "\n".join(found))


# ------------------------------------------------------------------------------ what the code and the pages cite

CITED = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)\b|\b([A-Z][A-Z_]+)(?:\.md)? ?§")


def cited_documents(text: str) -> set[str]:
    """The repository's documents a text cites: ``docs/X.md``, ``X.md`` (a page beside it or at the root), and
    ``NAME §N`` / ``NAME.md §N``. A path under another folder (NVIDIA's ``.../resnet50v1.5/README.md``) is not
    ours; neither is a file a command writes."""
    found = set()
    for page, section in CITED.findall(text):
        found.add(page or f"{section}.md")
    return found


def test_every_document_the_code_and_pages_cite_is_in_the_repository():
    sources = [*PAGES, *sorted(ROOT.glob("jaxtrain/**/*.py")), *sorted(ROOT.glob("experiments/*.py")),
               *sorted(ROOT.glob("tests/*.py")), *sorted(ROOT.glob("tools/**/*.py")), ROOT / "Makefile"]
    written = {"sweep.md"}  # what jaxtrain.sweep_report writes into a study's folder
    missing = [f"{_name(src)}: {doc}" for src in sources if src != Path(__file__)
               for doc in sorted(cited_documents(_text(src)) - written)
               if not any((ROOT / where / doc).exists() for where in ("", "docs"))]
    assert not missing, "cited, but not in the repository (cite a page that is, or state the fact):\n" + (
        "\n".join(missing))


def test_a_design_document_outside_the_repository_is_caught():
    assert cited_documents('From the contract (DESIGN.md "API"), REFERENCE §5, docs/gpu.md and api.md.') == {
        "DESIGN.md", "REFERENCE.md", "docs/gpu.md", "api.md"}
    assert cited_documents("ConvNets/resnet50v1.5/README.md") == set()
