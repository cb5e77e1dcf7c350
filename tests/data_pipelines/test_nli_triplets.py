"""SimCSE triplets from NLI pairs: one (premise, entailment, contradiction) per premise that has both."""

import json

import numpy as np

from data_pipelines.triplets import nli_triplets, triplets_of_group

PAIRS = [  # premise, hypothesis, label
    ("a man plays.", "a person plays.", 0), ("a man plays.", "a man plays well.", 1), ("a man plays.", "a man sleeps.", 2),
    ("a man plays.", "a human plays.", 0), ("a man plays.", "a man cries.", 2),
    ("dogs run.", "animals run.", 0), ("dogs run.", "dogs run fast.", 1),  # no contradiction: no triplet
    ("kids eat.", "children eat.", 0), ("kids eat.", "kids starve.", 2),
]


def group(premise):
    rows = [p for p in PAIRS if p[0] == premise]
    return {"text1": np.array([r[0] for r in rows], dtype=object), "text2": np.array([r[1] for r in rows], dtype=object),
            "label": np.array([r[2] for r in rows]), "similarity": np.array([0.9 - 0.3 * r[2] for r in rows])}


def test_one_triplet_per_premise_with_the_first_hypotheses_in_text_order():
    out = triplets_of_group(group("a man plays."))
    assert list(out["text1"]) == ["a man plays."]
    assert list(out["text2"]) == ["a human plays."]  # "a human" < "a person"
    assert list(out["text_neg"]) == ["a man cries."]  # "cries" < "sleeps"
    assert list(out["label"]) == [0] and list(out["similarity"]) == [0.9]


def test_a_premise_without_a_contradiction_gives_no_triplet():
    out = triplets_of_group(group("dogs run."))
    assert all(len(v) == 0 for v in out.values())


def test_ray_dataset_of_pairs_becomes_sorted_triplets(ray_local, tmp_path):
    from data_pipelines.readers import load_corpus

    path = tmp_path / "nli.jsonl"
    path.write_text("".join(json.dumps({"text1": a, "text2": b, "label": label, "similarity": 0.5}) + "\n"
                            for a, b, label in reversed(PAIRS)))
    ds, report = load_corpus("pairs", path)
    rows = nli_triplets(ds).take_all()
    assert report.rows_written == len(PAIRS)
    assert [(r["text1"], r["text2"], r["text_neg"]) for r in rows] == [
        ("a man plays.", "a human plays.", "a man cries."), ("kids eat.", "children eat.", "kids starve.")]
