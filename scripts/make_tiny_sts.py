"""Write configs/tiny/data/sts_pairs.csv: 256 synthetic STS pairs (STS-B CSV layout: sentence1,sentence2,score 0-5)
for the tiny Stage 2 config, so it runs from a copy of this repository alone (e.g. under ray job submit): the same
scene reworded scores about 5, an added detail 4, another action 2, another subject and action 0.5. Deterministic."""

import csv
import random
from pathlib import Path

from make_tiny_nli import ACTIONS, DETAILS, SUBJECTS


def main() -> None:
    rng = random.Random(0)
    rows = []
    for i in range(256):
        s, a = rng.choice(SUBJECTS), rng.choice(ACTIONS)
        kind = i % 4
        if kind == 0:
            other, score = f"{s} {a} right now.", 5.0
        elif kind == 1:
            other, score = f"{s} {a} {rng.choice(DETAILS)}.", 4.0
        elif kind == 2:
            other, score = f"{s} {rng.choice([x for x in ACTIONS if x != a])}.", 2.0
        else:
            other = f"{rng.choice([x for x in SUBJECTS if x != s])} {rng.choice([x for x in ACTIONS if x != a])}."
            score = 0.5
        jitter = min(5.0, max(0.0, score + rng.uniform(-0.4, 0.4)))
        rows.append([f"{s} {a}.", other, f"{jitter:.2f}"])
    out = Path(__file__).resolve().parent.parent / "configs" / "tiny" / "data" / "sts_pairs.csv"
    with open(out, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    print(f"wrote {len(rows)} pairs to {out}")


if __name__ == "__main__":
    main()
