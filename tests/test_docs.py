"""The docs' tables against the benchmarks behind their figures, so that the pages cannot drift from them.

A table that quotes a benchmark's figures carries ``<!-- checked: experiments.NAME -->`` on the line before it (an
HTML comment: the site and GitHub do not show it), and every copy of it, on any page, must be the same table. Its
checker below rebuilds the rows with the benchmark's own code from what needs no GPU: ``gpu_validate``: the
published figures, the ratios, which row is fitted, the format, and the ratios the prose quotes about the rows;
``bench_gpu_plans``: each row as its ``row()`` prints it (step time against examples/s, the largest batch per GPU);
``gpu_offload``: its no-remat rows are the plans table's; a kept GPU run (``<!-- checked:
docs/gpu-runs/DATE-GPU.json -->``): every figure of every row is the run's report's, at the precision shown (the
measured figures come from those files; tests/test_gpu_runs.py: the prose's). A marker naming a command with no
checker fails: a marker is a promise that the table is checked. (The estimates themselves need the CUDA plugin
and minutes of compiling; they are the commands' to regenerate.) Measured timings depend on the machine: those
tables name their command beside them (the docs' standard), which a reader re-runs. The pages' text:
tests/test_docs_text.py.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from docs_pages import ROOT, Table, checked_tables, text

# ------------------------------------------------------------------------------ experiments.gpu_validate


def _validation_rows(table: Table) -> list[dict]:
    """The rows as ``gpu_validate.rows`` returns them, from the page's estimates and labels; the published figures,
    the ratios and which row is fitted come from the benchmark itself."""
    from experiments import gpu_validate as v
    from experiments.gpu_check_report import kept_runs

    out, figures = [], v.figures(kept_runs())
    for cells in table.rows:
        assert len(cells) == 8, f"{table.where()}: {cells}"
        gpu, gpus, precision, batch, estimate, _published, _ratio, label = cells
        cell = (gpu.lower(), gpus, precision, batch)
        key = next((k for k in figures if (k[0], str(k[1]), k[4], str(k[3])) == cell), None)
        assert key is not None, f"{table.where()}: no published cell {cells[:4]} in experiments.gpu_validate"
        m = re.fullmatch(r"(?:held out|fitted); (\w+)-bound(?:; ([\d.]+)% of the step waits for collectives)?", label)
        assert m, f"{table.where()}: the row label {label!r} is not gpu_validate's"
        figure = float(estimate.replace(",", ""))
        out.append({"gpu": key[0], "gpus": key[1], "precision": key[4], "batch_per_gpu": key[3], "estimate": figure,
                    "published": figures[key], "ratio": figure / figures[key], "held_out": key != v.FIT_ON,
                    "bottleneck": m[1], "exposed_share": float(m[2] or 0) / 100})
    keys = sorted((r["gpu"], r["gpus"], r["precision"]) for r in out)
    assert keys == sorted((k[0], k[1], k[4]) for k in figures), f"{table.where()}: not one row per measured cell"
    return out


def _bold_bullets_after(table: Table) -> list[str]:
    """The bold openings of the bullets between the table and the next heading (the page's account of its rows)."""
    lines = text(table.page).splitlines()[table.line + len(table.lines):]
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
        named = {r["precision"] for r in rows if re.search(rf"\b{re.escape(r['precision'])}(?!\w)", bullet)}
        mine = [r for r in rows if r["gpu"] in gpus and (not named or r["precision"] in named)]
        rows_named = ", ".join(f"{r['gpu']} x{r['gpus']} {r['precision']}" for r in mine)
        for quoted in re.findall(r"(?<![\d.])\d+\.\d\d(?![\d.])", bullet):  # 1.35, 1.35x, 1.20-1.46
            assert quoted in {f"{r['ratio']:.2f}" for r in mine}, (
                f"{table.where()}: the bullet **{bullet}** quotes {quoted}, a ratio none of its rows "
                f"({rows_named}) has")
    claims = {"within 1.5x": [r for r in rows if "MLPerf" not in r["precision"]],
              "0.5-1.0": [r for r in rows if "MLPerf" in r["precision"]]}
    assert (v.BAND, v.MLPERF_BAND) == (1.5, (0.5, 1.0)), "the bands the page states are gpu_validate's"
    for claim, held in claims.items():
        if held:
            assert claim in text(table.page), f"{table.where()}: the page does not state the band {claim!r}"
        assert all(v.band(r)[0] <= r["ratio"] <= v.band(r)[1] for r in held if r["held_out"]), (
            f"{table.where()}: a ratio beyond the band {claim!r} the page states")


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


# ------------------------------------------------------------------------------ docs/gpu-runs/DATE-GPU.json

MODELS = {"LeNet": "lenet", "ResNet-18": "resnet18", "ResNet-50": "resnet50", "ViT": "vit"}


def shows(cell: str, value: float) -> bool:
    """The cell (``6,340``, ``15.7%``, ``0.04%``) shows ``value`` at the cell's own precision."""
    number = cell.replace(",", "")
    scale = 100 if number.endswith("%") else 1
    number = number.rstrip("%")
    return round(value * scale, len(number.partition(".")[2])) == float(number)


def mib(row: dict, name: str) -> float:
    """A kept row's memory in MiB: as a log printed it (``peak_mib``), or from gpu_check's bytes."""
    return row[f"{name}_mib"] if f"{name}_mib" in row else (
        row["peak_bytes"] if name == "peak" else row["memory_analysis"]["total"]) / 2**20


def check_gpu_run(table: Table):
    """One row per step the run measured, each figure the report's: ms, ESTIMATE, their ratio, examples/s, MFU,
    HFU, the peak and memory_analysis."""
    report = json.loads((ROOT / table.command).read_text())
    rows = report["steps"]["rows"]
    assert len(table.rows) == len(rows), f"{table.where()}: {len(table.rows)} rows, {table.command} has {len(rows)}"
    for cells in table.rows:
        model, precision, batch, ms, estimate, ratio, rate, mfu, hfu, memory = cells
        name, side = model.split()
        key = (MODELS[name], precision, int(batch), int(side.split("x")[0]))
        r = next((r for r in rows if (r["model"], r["precision"], r["batch"], r["input_shape"][0]) == key), None)
        assert r is not None, f"{table.where()}: no row {key} in {table.command}"
        peak, analysis = memory.removesuffix(" MiB").split(" / ")
        figures = {"ms": (ms, r["ms"]), "estimate_ms": (estimate, r["estimate_ms"]),
                   "time_ratio": (ratio, r["time_ratio"]),
                   "examples_per_second": (rate, r["examples_per_second"]), "mfu": (mfu, r["mfu"]),
                   "hfu": (hfu, r["hfu"]), "peak": (peak, mib(r, "peak")),
                   "memory_analysis": (analysis, mib(r, "memory_analysis"))}
        wrong = {k: v for k, v in figures.items() if not shows(*v)}
        assert not wrong, f"{table.where()}: {model} {precision} {batch}: not {table.command}'s figures: {wrong}"


CHECKERS = {"experiments.gpu_validate": check_gpu_validate, "experiments.bench_gpu_plans": check_bench_gpu_plans,
            "experiments.gpu_offload": check_gpu_offload}


def checker(command: str):
    """The check of a table under ``<!-- checked: COMMAND -->``: a benchmark's, or a kept GPU run's."""
    if command.startswith("docs/gpu-runs/") and (ROOT / command).is_file():
        return check_gpu_run
    return CHECKERS.get(command)


def test_every_checked_table_has_a_checker_and_each_command_one_table():
    tables = checked_tables()
    assert tables, "no <!-- checked: ... --> table found: the docs check checks nothing"
    for t in tables:
        assert checker(t.command), f"{t.where()}: no checker for {t.command!r} in tests/test_docs.py"
    for command in {t.command for t in tables}:
        copies = [t for t in tables if t.command == command]
        assert all(t.lines == copies[0].lines for t in copies), (
            f"the tables of {command} differ: {', '.join(t.where() for t in copies)}")


@pytest.mark.parametrize("table", checked_tables(), ids=lambda t: t.where())
def test_a_checked_table_is_what_its_benchmark_gives(table):
    checker(table.command)(table)


def test_a_misquoted_ratio_or_a_wrong_row_fails_the_check(tmp_path):
    """The checker is not vacuous: a ratio that is not the table's, in the prose or in a row, is caught."""
    explained = [t for t in checked_tables() if t.command == "experiments.gpu_validate" and _bold_bullets_after(t)]
    assert explained, "no page explains the validation table's rows in bold bullets any more"
    page = text(explained[0].page)
    check_gpu_validate(explained[0])  # as it stands, it passes
    quoted = re.search(r"^- \*\*\w+ \w+[^*]*?(\d\.\d\d)", page, re.MULTILINE)
    for broken in (page[:quoted.start(1)] + "0.01" + page[quoted.end(1):],
                   re.sub(r"\| (\d\.\d\d) \| held out", "| 9.99 | held out", page, count=1)):
        (tmp_path / "page.txt").write_text(broken)
        (table,) = [t for t in checked_tables([tmp_path / "page.txt"]) if t.command == "experiments.gpu_validate"]
        with pytest.raises(AssertionError):
            check_gpu_validate(table)


@pytest.mark.parametrize("command, cell, wrong", [("experiments.bench_gpu_plans", 7, "9.99 ms (2,930,343/s)"),
                                                   ("experiments.bench_gpu_plans", 4, "933,544 (1,000)"),
                                                   ("experiments.gpu_offload", 2, "1.00 MiB"),
                                                   ("docs/gpu-runs/2026-11-27-h100.json", 3, "0.36"),
                                                   ("docs/gpu-runs/2026-11-26-h200.json", 8, "0.4%"),
                                                   ("docs/gpu-runs/2026-11-26-h200.json", 9, "38 / 39 MiB")])
def test_a_plan_figure_changed_in_one_place_fails_the_check(command, cell, wrong):
    table = next(t for t in checked_tables() if t.command == command)
    checker(command)(table)  # as it stands, it passes
    i, row = next((i, r) for i, r in enumerate(table.rows) if r[1] in ("1", "none", "fp32"))  # 1 GPU, no remat
    row[cell] = wrong
    lines = list(table.lines)
    lines[2 + i] = "| " + " | ".join(row) + " |"
    broken = dataclasses.replace(table, lines=lines)
    with pytest.raises(AssertionError):
        checker(command)(broken)
