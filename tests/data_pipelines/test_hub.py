"""Hugging Face datasets as corpora (hf:<dataset>[:<config>]): the real datasets.load_dataset path on a local
dataset folder (no hub needed), hub column layouts, label -1 as no gold label, STS score scales, validation."""

import json

import pytest

from data_pipelines.hub import column_map, hub_spec
from data_pipelines.readers import BadDataError, load_corpus


def write_jsonl(folder, name, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_spec_and_columns():
    assert hub_spec("hf:stanfordnlp/snli") == ("stanfordnlp/snli", None)
    assert hub_spec("hf:nyu-mll/glue:mnli") == ("nyu-mll/glue", "mnli")
    assert column_map("pairs", ["premise", "hypothesis", "label"]) == {"text1": "premise", "text2": "hypothesis",
                                                                      "label": "label"}
    with pytest.raises(ValueError, match="no column for 'text2'"):
        column_map("pairs", ["premise", "label"])


def test_snli_layout_from_a_local_dataset_folder(ray_local, tmp_path):
    rows = [{"premise": "A man plays.", "hypothesis": "A person plays.", "label": 0},
            {"premise": "A man plays.", "hypothesis": "A man sleeps.", "label": 2},
            {"premise": "A man plays.", "hypothesis": "A man plays well.", "label": -1},  # no gold label
            {"premise": "Kids eat.", "hypothesis": "Children eat.", "label": 1}]
    folder = write_jsonl(tmp_path / "snli", "train.jsonl", rows)
    ds, report = load_corpus("pairs", f"hf:{folder}", split="train")
    got = sorted((r["text1"], r["text2"], r["label"]) for r in ds.take_all())
    assert got == [("A man plays.", "A man sleeps.", 2), ("A man plays.", "A person plays.", 0),
                   ("Kids eat.", "Children eat.", 1)]
    assert (report.rows_in, report.rows_written, report.rows_without_gold) == (3, 3, 1)


@pytest.mark.parametrize("scores, scale", [([5.0, 2.5, 0.0], 5.0), ([1.0, 0.5, 0.0], 1.0)])
def test_sts_scores_become_s_on_either_scale(ray_local, tmp_path, scores, scale):
    rows = [{"sentence1": f"s{i}", "sentence2": f"t{i}", "score": s} for i, s in enumerate(scores)]
    folder = write_jsonl(tmp_path / f"stsb{scale}", "train.jsonl", rows)
    ds, _ = load_corpus("sts", f"hf:{folder}", split="train")
    assert sorted(r["similarity"] for r in ds.take_all()) == [0.0, 0.5, 1.0]


def test_bad_hub_rows_are_named_by_split_and_row(ray_local, tmp_path):
    rows = [{"premise": "A man plays.", "hypothesis": "A person plays.", "label": 0},
            {"premise": "", "hypothesis": "x", "label": 0}]
    folder = write_jsonl(tmp_path / "bad", "train.jsonl", rows)
    with pytest.raises(BadDataError, match=r"\[train\]:2: field 'text1' is empty"):
        load_corpus("pairs", f"hf:{folder}", split="train")
    many = [{"premise": "" if i in (2, 10999) else f"p{i}", "hypothesis": "h", "label": 0} for i in range(12000)]
    folder = write_jsonl(tmp_path / "many", "train.jsonl", many)  # read as two blocks, numbered block by block
    with pytest.raises(BadDataError, match=r"2 bad record\(s\)(.|\n)*\[train\]:3: (.|\n)*\[train\]:11000: "):
        load_corpus("pairs", f"hf:{folder}", split="train")


def test_a_missing_dataset_names_the_source(ray_local, tmp_path):
    with pytest.raises(FileNotFoundError, match="hf:.*nothing-here"):
        load_corpus("pairs", f"hf:{tmp_path / 'nothing-here'}", split="train")


def class_label_folder(folder, names, labels):
    from datasets import ClassLabel, Dataset, Features, Value

    features = Features({"premise": Value("string"), "hypothesis": Value("string"), "label": ClassLabel(names=names)})
    data = Dataset.from_dict({"premise": ["A man plays."] * len(labels), "hypothesis": [f"h{i}" for i in
                                                                                        range(len(labels))],
                              "label": labels}, features=features)
    folder.mkdir(parents=True)
    data.to_parquet(str(folder / "train.parquet"))
    return folder


def test_class_labels_map_by_their_names_not_their_position(ray_local, tmp_path):
    folder = class_label_folder(tmp_path / "reordered", ["contradiction", "entailment", "neutral"], [0, 1, 2])
    ds, _ = load_corpus("pairs", f"hf:{folder}", split="train")
    assert sorted((r["text2"], r["label"]) for r in ds.take_all()) == [("h0", 2), ("h1", 0), ("h2", 1)]


def test_class_labels_of_another_task_are_refused(ray_local, tmp_path):
    folder = class_label_folder(tmp_path / "rte", ["entailment", "not_entailment"], [0, 1])
    with pytest.raises(ValueError, match="not_entailment"):
        load_corpus("pairs", f"hf:{folder}", split="train")
