"""Write configs/tiny/data/triples.jsonl: 96 synthetic RSE triples for the tiny relational configs, in two
relations: ``entailment`` (a sentence -> the same scene with less detail; hard negative: another action) and
``duplicate_question`` (a question -> the same question reworded; no negative, so training draws one from the
relation's other tails). Deterministic (seed 0)."""

import json
import random
from pathlib import Path

from make_tiny_nli import ACTIONS, DETAILS, SUBJECTS


def main() -> None:
    rng = random.Random(0)
    triples = []
    for _ in range(48):
        s, a, d = rng.choice(SUBJECTS), rng.choice(ACTIONS), rng.choice(DETAILS)
        other = rng.choice([x for x in ACTIONS if x != a])
        triples.append({"head": f"{s} {a} {d}.", "tail": f"{s} {a}.", "relation": "entailment",
                        "negative": f"{s} {other}."})
    for _ in range(48):
        s, a, d = rng.choice(SUBJECTS), rng.choice(ACTIONS), rng.choice(DETAILS)
        triples.append({"head": f"why {s} {a} {d}?", "tail": f"what makes {s} {a} {d}?",
                        "relation": "duplicate_question"})
    out = Path(__file__).resolve().parent.parent / "configs" / "tiny" / "data" / "triples.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in triples))
    print(f"wrote {len(triples)} triples to {out}")


if __name__ == "__main__":
    main()
