"""The worst ratio per test across tools/tolerance-sweep's variations (tests/tolerance.py logs one line per leaf).

    python tools/tolerance_report.py runs/tolerance-sweep/*.jsonl
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tolerance import MARGIN  # noqa: E402


def main(paths: list[str]) -> int:
    worst = defaultdict(dict)  # test -> variation -> (ratio, leaf, err)
    for path in paths:
        variation = Path(path).stem
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            seen = worst[row["test"]].get(variation, (-1.0, "", 0.0))
            if row["ratio"] > seen[0]:
                worst[row["test"]][variation] = (row["ratio"], row["leaf"], row["err"])
    variations = sorted({v for per in worst.values() for v in per})
    print("| test | " + " | ".join(variations) + " | worst leaf |")
    print("|---|" + "---|" * (len(variations) + 1))
    overall = 0.0
    for test in sorted(worst):
        per = worst[test]
        cells = [f"{per[v][0]:.2f}" if v in per else "" for v in variations]
        top = max(per.values())
        overall = max(overall, top[0])
        print(f"| {test.split('::')[-1]} | " + " | ".join(cells) + f" | {top[1]} ({top[2]:.2g}) |")
    print(f"\nworst ratio {overall:.2f}; the policy allows {MARGIN:g} ({MARGIN / max(overall, 1e-9):.1f}x to spare)")
    return 0 if overall * 10 <= MARGIN else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
