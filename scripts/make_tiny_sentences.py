"""Write configs/tiny/data/sentences_san.jsonl: 128 distinct synthetic sentences, each with a syntactically aligned
negative (the same subject and detail, another action: what SAN's mask-and-fill aims at), for the tiny unsupervised
configs (no masked LM needed). Deterministic (seed 0)."""

import json
import random
from pathlib import Path

from make_tiny_nli import ACTIONS, DETAILS, SUBJECTS


def main() -> None:
    rng = random.Random(0)
    combos = [(s, a, d) for s in SUBJECTS for a in ACTIONS for d in DETAILS]
    rows = []
    for subject, action, detail in rng.sample(combos, 128):
        other = rng.choice([a for a in ACTIONS if a != action])
        rows.append({"text": f"{subject} {action} {detail}.", "negative": f"{subject} {other} {detail}."})
    out = Path(__file__).resolve().parent.parent / "configs" / "tiny" / "data" / "sentences_san.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} sentences to {out}")


if __name__ == "__main__":
    main()
