"""Write configs/tiny/data/lists.jsonl: 32 synthetic ranked lists of 6 sentences for the tiny post-training
configs: a seed, then sentences that change more of it at each position (detail, action, subject, ...), the
shape of a directionally generated list. Deterministic (seed 0)."""

import json
import random
from pathlib import Path

from make_tiny_nli import ACTIONS, DETAILS, SUBJECTS


def main() -> None:
    rng = random.Random(0)
    lists = []
    for _ in range(32):
        s, a, d = rng.choice(SUBJECTS), rng.choice(ACTIONS), rng.choice(DETAILS)
        s2, a2, d2 = (rng.choice([x for x in pool if x != cur]) for pool, cur in ((SUBJECTS, s), (ACTIONS, a),
                                                                                  (DETAILS, d)))
        a3 = rng.choice([x for x in ACTIONS if x not in (a, a2)])
        lists.append({"sentences": [f"{s} {a} {d}.", f"{s} {a} {d2}.", f"{s} {a2} {d}.", f"{s} {a2} {d2}.",
                                    f"{s2} {a2} {d2}.", f"{s2} {a3}."]})
    out = Path(__file__).resolve().parent.parent / "configs" / "tiny" / "data" / "lists.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in lists))
    print(f"wrote {len(lists)} lists to {out}")


if __name__ == "__main__":
    main()
