"""The docs' text against the code: the commands they quote, the result line, what they cite, what they leave out.

- Every ``--flag`` of an ``experiments.NAME`` (or ``jaxtrain.sweep`` / ``jaxtrain.launch``) command quoted in
  README.md and docs/*.md is a flag that command's ``--help`` lists.
- ``make demo``'s example result line is one line, in the run's format, and docs/results.md's 2-device row.
- Every document the pages, the code and the tests cite is in the repository.
- No test counts or test-suite durations in the docs: they go stale with every test added (the CI log has them).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest
from docs_pages import PAGES, ROOT, name, text

# ------------------------------------------------------------------------------ the commands the pages quote

COMMAND = re.compile(r"(?:python -m )?\b((?:experiments\.[a-z_0-9]+)|jaxtrain\.sweep|jaxtrain\.launch)\b")


def _help(module: str) -> str:
    """What ``python -m MODULE --help`` prints, in-process."""
    from jaxtrain import cli

    mod = importlib.import_module(f"{module}.__main__" if module == "jaxtrain.sweep" else module)
    entry = getattr(mod, "run", None) or mod.main  # experiments.distill: run() checks --teacher and --student
    if entry is cli.main:  # experiments.lenet, resnet18, vit: RunConfig's flags
        return cli.make_parser(module.split(".")[-1]).format_help()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        entry(["--help"])
    return out.getvalue()


def _code(page: Path) -> list[str]:
    """The page's code: each command line of its code blocks (continuations joined) and each inline code span."""
    fragments, prose, block = [], [], None
    for line in text(page).splitlines():
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


# Flags a command takes that its --help does not list (none today: keep the list, and keep it empty).
UNLISTED: dict[str, set[str]] = {}


def test_every_quoted_flag_is_one_its_command_has():
    helps, wrong = {}, []
    for page in PAGES:
        for module, flag in quoted_flags(page):
            if module not in helps:
                helps[module] = set(re.findall(r"--[a-z][a-z0-9-]*", _help(module))) | UNLISTED.get(module, set())
            if flag not in helps[module]:
                wrong.append(f"{name(page)}: {module} {flag}")
    assert not wrong, "flags the commands do not have (see each one's --help):\n" + "\n".join(wrong)


def test_the_flag_check_reads_code_blocks_and_spans(tmp_path):
    page = tmp_path / "page.txt"
    page.write_text("Run `python -m experiments.bench --model lenet\n--no-such-flag`.\n\n```sh\n"
                    "python -m jaxtrain.sweep --trials 2 \\\n"
                    "    --nope 1 -- python -m experiments.lenet --devices 2\n```\n")
    assert sorted(quoted_flags(page)) == [("experiments.bench", "--model"), ("experiments.bench", "--no-such-flag"),
                                          ("experiments.lenet", "--devices"), ("jaxtrain.sweep", "--nope"),
                                          ("jaxtrain.sweep", "--trials")]


# ------------------------------------------------------------------------------ the run's result line

# jaxtrain.driver.runner's
RESULT_LINE = re.compile(r"test acc \d\.\d\d, \d+\.\d sec/epoch on \d+ devices? \((?:cpu|gpu)\)")


def test_the_example_result_lines_are_the_same_and_the_results_pages():
    """``make demo``'s result line, wherever a page shows it: as the run prints it
    (``jaxtrain/driver/runner.py``), and the 2-device row of docs/results.md."""
    shown = {(name(page), line) for page in PAGES
             for line in re.findall(r"`(test acc [^`]*sec/epoch[^`]*)`", text(page))}
    assert len(shown) >= 2, shown
    assert all(RESULT_LINE.fullmatch(line) for _, line in shown), shown
    ((acc, sec),) = re.findall(r"^\| jaxtrain, 2 CPU devices \| ([\d.]+) \| ([\d.]+) \|$",
                               text(ROOT / "docs/results.md"), re.MULTILINE)
    result = f"test acc {float(acc):.2f}, {float(sec):.1f} sec/epoch on 2 devices (cpu)"
    assert {line for _, line in shown} == {result}, shown


# ------------------------------------------------------------------------------ what does not belong in docs

COUNTS = re.compile(r"\b\d[\d,]* (?:passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b"
                    r"|\b\d[\d,]* tests (?:collected|ran|run)\b")


def test_no_test_counts_or_suite_durations_in_the_docs():
    found = [f"{name(page)}:{i}: {line.strip()[:100]}" for page in PAGES
             for i, line in enumerate(text(page).splitlines(), 1) if COUNTS.search(line)]
    assert not found, "test counts (and the suite's durations beside them) go stale; the CI log has them:\n" + (
        "\n".join(found))


# ------------------------------------------------------------------------------ what the code and the pages cite

CITED = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)\b|\b([A-Z][A-Z_]+)(?:\.md)? ?§")


def cited_documents(source: str) -> set[str]:
    """The repository's documents a text cites: ``docs/X.md``, ``X.md`` (a page beside it or at the root), and
    ``NAME §N`` / ``NAME.md §N``. A path under another folder (NVIDIA's ``.../resnet50v1.5/README.md``) is not
    ours; neither is a file a command writes."""
    found = set()
    for page, section in CITED.findall(source):
        found.add(page or f"{section}.md")
    return found


def test_every_document_the_code_and_pages_cite_is_in_the_repository():
    sources = [*PAGES, *sorted(ROOT.glob("jaxtrain/**/*.py")), *sorted(ROOT.glob("experiments/*.py")),
               *sorted(ROOT.glob("tests/*.py")), *sorted(ROOT.glob("tools/**/*.py")), ROOT / "Makefile"]
    written = {"sweep.md", "report.md"}  # what jaxtrain.sweep.report writes into a study's folder; gpu_check's report
    missing = [f"{name(src)}: {doc}" for src in sources if src != Path(__file__)
               for doc in sorted(cited_documents(text(src)) - written)
               if not any((ROOT / where / doc).exists() for where in ("", "docs"))]
    assert not missing, "cited, but not in the repository (cite a page that is, or state the fact):\n" + (
        "\n".join(missing))


def test_a_design_document_outside_the_repository_is_caught():
    assert cited_documents('From the contract (DESIGN.md "API"), REFERENCE §5, docs/gpu.md and api.md.') == {
        "DESIGN.md", "REFERENCE.md", "docs/gpu.md", "api.md"}
    assert cited_documents("ConvNets/resnet50v1.5/README.md") == set()


# ------------------------------------------------------------------------------ the defaults the pages state


def test_the_image_sizes_data_md_gives_are_the_recipes():
    """(issue 64) docs/data.md gave resnet18_imagenet's default --image-size as 32 (it is 224)."""
    from jaxtrain.models import MODELS

    said = re.search(r"`--image-size` \(default:(.*?)32 for the others\)", text(ROOT / "docs" / "data.md"), re.S)
    assert said, "docs/data.md no longer says --image-size's defaults"
    assert "224" in said.group(1)
    assert set(re.findall(r"`([a-z0-9_]+)`", said.group(1))) == {m for m, d in MODELS.items() if d.image_size == 224}
    assert {d.image_size for d in MODELS.values()} == {32, 224}


def test_docs_architecture_says_where_every_setting_lives_once():
    """Its table "Where each setting lives" gives each section of a RunConfig with exactly its settings."""
    from jaxtrain.driver.sections import FIELDS, SECTIONS

    page = text(ROOT / "docs" / "architecture.md")
    section = page.split("## Where each setting lives", 1)[1].split("\n## ", 1)[0]
    rows = {re.findall(r"`([a-z_]+)`", cells[0])[0]: re.findall(r"`([a-z_]+)`", cells[1])
            for row in section.splitlines() if row.startswith("| `") for cells in [row.split(" | ")]}
    assert list(rows) == list(SECTIONS)
    for title, settings in rows.items():
        assert settings == [n for n, (s, _) in FIELDS.items() if s == title], title
