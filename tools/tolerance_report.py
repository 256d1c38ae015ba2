"""The worst ratio per test across tools/tolerance-sweep's variations (tests/tolerance.py logs one line per leaf),
and each test's resolution: the largest allowance relative to a leaf's own move, over the leaves that moved at
least FLOOR of their tree's largest move (a fault on such a leaf larger than this share of its move fails).

    python tools/tolerance_report.py runs/tolerance-sweep/*.jsonl
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tolerance import FLOOR, MARGIN  # noqa: E402


def main(paths: list[str]) -> int:
    worst = defaultdict(dict)  # test -> variation -> (ratio, leaf, err)
    resolution = defaultdict(float)  # test -> the largest allowance / own move
    flipped = defaultdict(set)  # test -> the leaves that passed as a flipped kink's (tests/tolerance.py)
    for path in paths:
        variation = Path(path).stem
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        largest = defaultdict(float)  # (test, tree) -> its largest move
        for row in rows:
            if row.get("flipped"):
                flipped[row["test"]].add(f"{variation}: {row['leaf']}")
                continue
            seen = worst[row["test"]].get(variation, (-1.0, "", 0.0))
            if row["ratio"] > seen[0]:
                worst[row["test"]][variation] = (row["ratio"], row["leaf"], row["err"])
            key = (row["test"], row["leaf"].split("[")[0])
            largest[key] = max(largest[key], row.get("moved", 0.0))
        for row in rows:
            moved, tree = row.get("moved", 0.0), largest[(row["test"], row["leaf"].split("[")[0])]
            if moved and moved >= FLOOR * tree:
                resolution[row["test"]] = max(resolution[row["test"]], MARGIN * row["bound"] / moved)
    variations = sorted({v for per in worst.values() for v in per})
    print("| test | " + " | ".join(variations) + " | worst leaf | resolution | leaves passed as a flip |")
    print("|---|" + "---|" * (len(variations) + 3))
    overall = 0.0
    for test in sorted(worst):
        per = worst[test]
        cells = [f"{per[v][0]:.2f}" if v in per else "" for v in variations]
        top = max(per.values())
        overall = max(overall, top[0])
        share = f"{resolution[test]:.2%}" if test in resolution else ""
        flips = len(flipped.get(test, ()))
        print(f"| {test.split('::')[-1]} | " + " | ".join(cells) + f" | {top[1]} ({top[2]:.2g}) | {share} | {flips} |")
    print(f"\nworst ratio {overall:.2f}; the policy allows {MARGIN:g} ({MARGIN / max(overall, 1e-9):.1f}x to spare)")
    return 0 if overall * 10 <= MARGIN else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
