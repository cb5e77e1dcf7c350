"""Write configs/tiny/data/nli_pairs.jsonl: 128 synthetic NLI pairs with a similarity S, for the tiny smoke
configs (no teacher needed). Entailments paraphrase the premise, neutrals add a detail, contradictions change
the subject or the action; S is drawn around 0.8 / 0.5 / 0.2 by label. Deterministic (seed 0)."""

import json
import random
from pathlib import Path

SUBJECTS = ["a man", "a woman", "a boy", "a girl", "two people", "a dog", "a child", "the group"]
ACTIONS = ["is playing music", "is walking down the street", "is eating food", "is riding a bike",
           "is sitting near the water", "is running in the park", "is holding a ball", "is looking at the city"]
DETAILS = ["while wearing a red hat", "with a big black dog", "on a sunny day", "in the snow"]


def main() -> None:
    rng = random.Random(0)
    rows = []
    for i in range(128):
        subject, action = rng.choice(SUBJECTS), rng.choice(ACTIONS)
        premise = f"{subject} {action}."
        label = i % 3
        if label == 0:
            hypothesis, mean = f"{subject} {action} outside.", 0.8
        elif label == 1:
            hypothesis, mean = f"{subject} {action} {rng.choice(DETAILS)}.", 0.5
        else:
            other = rng.choice([a for a in ACTIONS if a != action])
            hypothesis, mean = f"{subject} {other}.", 0.2
        s = min(1.0, max(0.0, rng.gauss(mean, 0.1)))
        rows.append({"text1": premise, "text2": hypothesis, "label": ["entailment", "neutral", "contradiction"][label],
                     "similarity": round(s, 4)})
    out = Path(__file__).resolve().parent.parent / "configs" / "tiny" / "data" / "nli_pairs.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} pairs to {out}")


if __name__ == "__main__":
    main()
