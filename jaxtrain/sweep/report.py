"""A sweep's end: the table of trials (best first), the best settings as a command line, Optuna's plots."""

from __future__ import annotations

import warnings
from pathlib import Path


def rows(study) -> list[dict]:
    """Every trial as a row; the finished ones best first (complete, then pruned), then the rest by number."""
    import optuna

    sign = -1 if study.direction == optuna.study.StudyDirection.MAXIMIZE else 1
    order = {"COMPLETE": 0, "PRUNED": 1, "FAIL": 2, "RUNNING": 3, "WAITING": 4}

    def key(t):
        value = t.value if t.value is not None else _last(t)
        return order[t.state.name], sign * value if value is not None else 0.0, t.number

    return [{"trial": t.number, "state": t.state.name.lower() + (" (diverged)" if "diverged" in t.user_attrs else ""),
             "value": t.value, "last_reported": _last(t),
             "epochs": len(t.intermediate_values), "sec": t.user_attrs.get("sec"), "params": t.params,
             "out": t.user_attrs.get("out")} for t in sorted(study.get_trials(deepcopy=False), key=key)]


def _last(t):
    return t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None


def table(study, objective: str) -> str:
    """Markdown table of the trials, best first."""
    names = sorted({k for t in study.get_trials(deepcopy=False) for k in t.params})
    head = ["trial", "state", objective, "epochs", "sec", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows(study):
        value = r["value"] if r["value"] is not None else r["last_reported"]
        shown = "" if value is None else f"{value:.4f}" + ("" if r["value"] is not None else " (last epoch)")
        cells = [r["trial"], r["state"], shown, r["epochs"], "" if r["sec"] is None else f"{r['sec']:.0f}",
                 *(_fmt(r["params"].get(n)) for n in names)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def plots(study, folder: Path) -> dict[str, str]:
    """history.png, importances.png, slice.png in ``folder`` with Optuna's matplotlib plots; {name: why not} for
    those that could not be drawn (e.g. importances need 2 finished trials)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ov

    skipped = {}
    for name, draw in (("history", ov.plot_optimization_history), ("importances", ov.plot_param_importances),
                       ("slice", ov.plot_slice)):
        try:
            with warnings.catch_warnings():  # Optuna's ExperimentalWarning
                warnings.simplefilter("ignore")
                drawn = draw(study)
            figure = (drawn.flat[0] if hasattr(drawn, "flat") else drawn).figure
            figure.savefig(folder / f"{name}.png", dpi=90, bbox_inches="tight")
            plt.close(figure)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            skipped[name] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            plt.close("all")
    return skipped


def report(study, command, objective: str, folder: Path, say) -> None:
    """Print the table and the best command line; write sweep.md and the plots into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = table(study, objective)
    untracked = [t.number for t in study.get_trials(deepcopy=False) if "track_failed" in t.user_attrs]
    if untracked:  # a view, not the record: said, not fatal
        text += (f"\n\nwarning: the tracker stopped logging in trial(s) {', '.join(map(str, untracked))} (each "
                 "one's trial.log says why); their metrics.jsonl and summary.json hold the record")
    say(text)
    try:
        best = study.best_trial
    except ValueError:
        say("no complete trial yet")
        (folder / "sweep.md").write_text(f"# Study {study.study_name}\n\n{text}\n")
        return
    line = command.best_line(best.params)
    say(f"best: trial {best.number}, {objective} {best.value:.4f}\n  {line}")
    skipped = plots(study, folder)
    drawn = [f"{n}.png" for n in ("history", "importances", "slice") if n not in skipped]
    say(f"wrote {folder}/sweep.md" + (f", {', '.join(drawn)}" if drawn else "")
        + "".join(f"; {n}.png not drawn ({why})" for n, why in skipped.items()))
    (folder / "sweep.md").write_text(f"# Study {study.study_name}\n\n{text}\n\nBest: trial {best.number}, "
                                     f"{objective} {best.value:.4f}:\n\n    {line}\n")
