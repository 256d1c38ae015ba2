"""Every measured GPU figure has a file behind it: the GPU runs kept in docs/gpu-runs/ (``experiments.gpu_check``'s
report.json, one per run, named DATE-GPU.json), what the docs and ``experiments.gpu_validate`` read from them, and
gpu_validate's verdict and exit code. The docs' tables of a run's steps: tests/test_docs.py (``check_gpu_run``)."""

import json
import re

import pytest
from docs_pages import PAGES, checked_tables, name, text

from experiments import gpu_check_report as report
from experiments import gpu_validate as v

RUNS = report.kept_runs()
CELLS = v.figures(RUNS)  # every row's figure, as gpu_validate reads them
GPU = re.compile(r"\b(A100|B200|H100|H200|V100)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
NAMED = re.compile(r"gpu-runs/(20\d\d-\d\d-\d\d-\w+)\.json")
MS = re.compile(r"((?:\d+\.\d+(?: / | against |, | and ))*\d+\.\d+) ms\b")  # 40.38 against 49.16 ms; 4.26 / 4.72 ms


def sections(page_text: str) -> list[str]:
    """A page's sections: each heading with the text up to the next heading."""
    return re.split(r"\n(?=#+ )", page_text)


def numbers(x):
    """Every number in a report."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        return [n for item in x for n in numbers(item)]
    return [x] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


def shows(figure: str, values) -> bool:
    """``figure`` (``40.38``) is one of ``values`` at the precision it is written with."""
    return any(round(value, len(figure.partition(".")[2])) == float(figure) for value in values)


def unreported(page_text: str, runs: dict = RUNS) -> list[str]:
    """What a page's measured GPU figures lack: a section with a GPU and a run's date names that run's report
    (docs/gpu-runs/DATE-GPU.json), which exists; a transcribed report is said to be one in the section; each
    figure in ms a paragraph naming a report quotes, or any paragraph of a section headed "Measured ...", is one of
    the section's named reports' figures."""
    problems = []
    for section in sections(page_text):
        title, named = section.splitlines()[0], NAMED.findall(section)
        if GPU.search(section):
            for date in set(DATE.findall(section)) - {n[:10] for n in named}:
                problems.append(f"{title}: a GPU measured on {date} names no report (docs/gpu-runs/{date}-GPU.json)")
        for run in named:
            if run not in runs:
                problems.append(f"{title}: names docs/gpu-runs/{run}.json, which is not kept")
            elif runs[run]["run"]["source"].startswith(report.TRANSCRIBED) and report.TRANSCRIBED not in section:
                problems.append(f"{title}: quotes {run}, whose report is lost, without {report.TRANSCRIBED!r}")
        kept = sorted({run for run in named if run in runs})
        pool = [n for run in kept for n in numbers(runs[run])]
        for paragraph in re.split(r"\n\s*\n|\n(?=- )", section):
            if NAMED.search(paragraph) or kept and "measured" in title.lower():
                prose = "\n".join(line for line in paragraph.splitlines() if not line.startswith("|"))  # tables:
                problems += [f"{title}: {figure} ms is no figure of {', '.join(kept)}"  # tests/test_docs.py
                             for chain in MS.findall(prose) for figure in re.findall(r"\d+\.\d+", chain)
                             if not shows(figure, pool)]
    return problems


def test_each_kept_run_is_named_by_its_date_and_gpu_and_says_where_its_figures_come_from():
    assert {"2026-11-26-h200", "2026-11-27-h100"} <= set(RUNS)
    for run_name, run in RUNS.items():
        assert run_name == f"{run['run']['date']}-{run['run']['gpu']}", run_name
        assert run["run"]["source"].startswith((report.TRANSCRIBED, "experiments.gpu_check's report.json")), run_name
        for row in run["steps"]["rows"]:  # what the docs and gpu_validate read
            assert {"model", "precision", "remat", "devices", "batch", "input_shape", "ms", "estimate_ms",
                    "examples_per_second"} <= set(row), (run_name, row)


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_measured_gpu_figure_names_its_report(page):
    assert unreported(text(page)) == []


def test_a_measurement_without_its_report_or_a_wrong_figure_is_caught():
    ok = ("## On one H100 (2026-11-27)\n\n`docs/gpu-runs/2026-11-27-h100.json` (transcribed from the run's log; "
          "report not kept): ResNet-50 49.16 ms, remat 4.26 / 4.72 ms.\n")
    assert unreported(ok) == []
    for broken, why in [(ok.replace("`docs/gpu-runs/2026-11-27-h100.json`", "a run"), "names no report"),
                        (ok.replace("2026-11-27-h100.json", "2026-11-28-h100.json"), "not kept"),
                        (ok.replace("transcribed from the run's log; report not kept", "kept"), "whose report is lost"),
                        (ok.replace("4.72 ms", "4.73 ms"), "4.73 ms is no figure")]:
        problems = unreported(broken)
        assert any(why in problem for problem in problems), problems
    page = text(next(p for p in PAGES if p.name == "gpu.md"))  # a remat figure off by 0.01 in the H100's bullets
    assert unreported(page.replace("4.72 / 5.24", "4.73 / 5.24")) == [
        "### Measured on one H100 (2026-11-27): 4.73 ms is no figure of 2026-11-26-h200, 2026-11-27-h100"]


def test_gpu_validate_reads_the_measured_rows_from_the_kept_runs(tmp_path):
    assert {k: CELLS[k] for k in CELLS if k[4] == v.MEASURED} == v.measured(RUNS) == {
        ("h200", 1, "bf16", 256, v.MEASURED): 6_340, ("h200", 1, "bf16", 400, v.MEASURED): 6_560,
        ("h100", 1, "bf16", 256, v.MEASURED): 5_207, ("h100", 1, "bf16", 400, v.MEASURED): 5_335}
    row = {"model": "resnet50", "precision": "bf16", "remat": "none", "devices": 8, "batch": 2048,
           "input_shape": [224, 224, 3], "examples_per_second": 40_000.0}
    other = [{**row, "remat": "full"}, {**row, "input_shape": [32, 32, 3]}, {**row, "model": "vit"}]
    kept = {"run": {"gpu": "b200"}, "steps": {"rows": [row, *other]}}
    (tmp_path / "2027-01-01-b200.json").write_text(json.dumps(kept))
    assert v.measured(report.kept_runs(tmp_path)) == {("b200", 8, "bf16", 256, v.MEASURED): 40_000.0}


def _estimates(ratios: dict) -> callable:
    """A stand-in for gpu_validate's compiles: each cell's estimate at ``ratios[cell]`` (default 1) of its figure."""
    def estimate(cells, folder=None):
        return {k: {"examples_per_second": ratios.get(k, 1.0) * CELLS[k], "bottleneck": "memory", "exposed": 0.0,
                    "seconds": 1.0, "roofline": 0.06, "launch": 0.001} for k in cells}
    return estimate


def test_gpu_validate_exits_1_when_a_held_out_row_leaves_its_band_and_0_within(capsys):
    ours = ("h100", 1, "bf16", 256, v.MEASURED)
    mlperf = ("h100", 8, "bf16", 400, "AMP (MLPerf v3.0)")
    assert v.main(["--gpu", "h100"], estimate=_estimates({ours: 1.49, mlperf: 0.51})) == 0
    out = capsys.readouterr().out
    assert "every ratio within 1.5x" in out
    assert out.splitlines()[0] == (f"jaxtrain's measured rows from {report.RUNS}: 2026-11-26-h200.json, "
                                   "2026-11-27-h100.json")  # the files read, named
    for cell, ratio in [(ours, 1.51), (ours, 0.66), (mlperf, 0.49), (mlperf, 1.01)]:
        assert v.main(["--gpu", "h100"], estimate=_estimates({cell: ratio})) == 1, (cell, ratio)
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("1 held-out ratio(s) outside their band") and f"{ratio:.2f}" in last, last
    # the fitted row is 1.00 by construction: its ratio never fails the command
    assert v.main(["--gpu", "a100"], estimate=_estimates({v.FIT_ON: 3.0})) == 0


def test_gpu_validate_exits_0_on_the_estimates_the_docs_table_holds():
    """The docs' validation table holds the estimates the command printed (tests/test_docs.py checks that): fed
    back, they pass the command's own verdict."""
    (table, *_) = [t for t in checked_tables() if t.command == "experiments.gpu_validate"]
    printed = {}
    for gpu, gpus, label, batch, estimate, *_ in table.rows:
        key = next(k for k in CELLS if (k[0], str(k[1]), k[4], str(k[3])) == (gpu.lower(), gpus, label, batch))
        printed[key] = float(estimate.replace(",", "")) / CELLS[key]
    assert len(printed) == len(CELLS)
    assert v.main([], estimate=_estimates(printed)) == 0


def test_the_mlperf_floor_is_what_the_measured_runs_justify():
    """0.5: jaxtrain's step measured at 400 per GPU runs at a share S of MLPerf's per-GPU throughput; its
    estimate may be S / 1.5 of MLPerf's within its own band. The floor is the least of those, to within 0.01
    (docs/gpu-estimate.md, "The bands")."""
    floors = v.mlperf_floor(CELLS)
    assert set(floors) == {"h100", "h200"}, floors
    assert v.MLPERF_BAND[0] <= min(floors.values()) < v.MLPERF_BAND[0] + 0.01, floors


def test_gpu_validate_without_run_files_or_with_two_of_one_cell_is_one_line_exit_1(tmp_path, capsys):
    """Read when it runs: no kept run (a missing or empty folder, or no file with a measured row) would silently
    drop the measured rows and still say 'every ratio within 1.5x'; two runs of one GPU, GPU count and batch would
    silently overwrite one another."""
    def run(folder) -> tuple[int, list[str]]:
        code = v.main(["--gpu", "h100"], estimate=_estimates({}), runs=folder)
        out, err = capsys.readouterr()
        return code, err.strip().splitlines()

    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    lenet = {"run": {"gpu": "h100"}, "steps": {"rows": [r for r in RUNS["2026-11-27-h100"]["steps"]["rows"]
                                                         if r["model"] != "resnet50"]}}
    (tmp_path / "other" / "2026-11-27-h100.json").write_text(json.dumps(lenet))
    for folder in (tmp_path / "missing", tmp_path / "empty", tmp_path / "other"):
        code, err = run(folder)
        assert code == 1 and len(err) == 1, (folder, err)
        assert err[0].startswith(f"gpu_validate: error: {folder}: no GPU run file (DATE-GPU.json) with jaxtrain's "
                                 "ResNet-50 row"), err
    (tmp_path / "two").mkdir()
    for run_name in ("2026-11-27-h100", "2026-12-01-h100"):
        (tmp_path / "two" / f"{run_name}.json").write_text(json.dumps(RUNS["2026-11-27-h100"]))
    code, err = run(tmp_path / "two")
    assert code == 1 and err == ["gpu_validate: error: 2026-11-27-h100.json and 2026-12-01-h100.json both measure "
                                 "H100 x1 at 256 images per GPU: keep one of them in the runs folder"], err
    with pytest.raises(SystemExit) as e:  # a GPU of no row: not an empty table that passes
        v.main(["--gpu", "b200"], estimate=_estimates({}))
    assert e.value.code == 2 and "argument --gpu: no rows of b200 (rows: a100, h100, h200, v100)" in (
        capsys.readouterr().err)
