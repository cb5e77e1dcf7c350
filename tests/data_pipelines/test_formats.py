"""Each reader on small files of its format, label normalisation, and every validation rule with line numbers
(pure Python, no Ray)."""

import json
import math

import pytest

from data_pipelines.formats import detect_format, parse
from data_pipelines.records import RecordError, normalise_label


def write(path, text, mode="w"):
    if mode == "wb":
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("value, want", [("entailment", 0), ("Neutral", 1), ("CONTRADICTION ", 2), (0, 0), (2, 2),
                                         ("1", 1), (2.0, 2)])
def test_labels_normalise_to_e0_n1_c2(value, want):
    assert normalise_label(value) == want


@pytest.mark.parametrize("value", ["-", "entail", 3, -1, None, True, 1.5])
def test_unknown_labels_are_errors(value):
    with pytest.raises(RecordError, match="unknown label"):
        normalise_label(value)


def test_pairs_jsonl_good_and_every_kind_of_bad(tmp_path):
    lines = [
        {"text1": "a man", "text2": "a person", "label": "entailment", "similarity": 0.9},  # 1 good
        {"text1": "a man", "text2": "a dog", "label": 2},  # 2 good, no similarity
        {"text1": "", "text2": "x", "label": 0},  # 3 empty text
        {"text2": "x", "label": 0},  # 4 missing text1
        {"text1": "a", "text2": "b", "label": "maybe"},  # 5 unknown label
        {"text1": "a", "text2": "b", "label": 1, "similarity": 1.5},  # 6 similarity out of range
        {"text1": "a", "text2": "b", "label": 1, "similarity": "high"},  # 7 similarity not a number
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{not json\n[1, 2]\n"
    path = write(tmp_path / "p.jsonl", text)
    rows = list(parse("pairs", "pairs_jsonl", path))
    assert [r["line"] for r in rows] == list(range(1, 10))
    good = [r for r in rows if r["error"] is None]
    assert [(r["text1"], r["label"]) for r in good] == [("a man", 0), ("a man", 2)]
    assert good[0]["similarity"] == 0.9 and math.isnan(good[1]["similarity"])
    errors = {r["line"]: r["error"] for r in rows if r["error"]}
    assert errors[3] == "field 'text1' is empty"
    assert errors[4] == "missing field 'text1'"
    assert "unknown label 'maybe'" in errors[5]
    assert "'similarity' must be a number in [0, 1], got 1.5" in errors[6]
    assert "got 'high'" in errors[7]
    assert errors[8].startswith("invalid JSON")
    assert errors[9] == "expected a JSON object, got list"
    assert all(r["raw"] for r in rows if r["error"])


def test_invalid_utf8_is_reported_with_its_line(tmp_path):
    good = json.dumps({"text1": "a", "text2": "b", "label": 0}).encode()
    path = write(tmp_path / "p.jsonl", good + b"\n" + b'{"text1": "\xff\xfe", "text2": "b", "label": 0}\n', "wb")
    rows = list(parse("pairs", "pairs_jsonl", path))
    assert rows[0]["error"] is None and rows[1]["line"] == 2 and rows[1]["error"].startswith("invalid UTF-8")


def test_snli_jsonl_drops_dash_gold_labels_as_skipped(tmp_path):
    rows = [{"sentence1": "a", "sentence2": "b", "gold_label": "neutral"},
            {"sentence1": "a", "sentence2": "c", "gold_label": "-"}]
    path = write(tmp_path / "snli.jsonl", "\n".join(json.dumps(r) for r in rows))
    assert detect_format("pairs", path) == "snli_jsonl"
    out = list(parse("pairs", "snli_jsonl", path))
    assert out[0]["label"] == 1 and not out[0]["skipped"]
    assert out[1]["skipped"] and out[1]["error"] is None


def test_csv_pairs_with_header(tmp_path):
    path = write(tmp_path / "p.csv", 'text1,text2,label,similarity\n"a, b",c,contradiction,0.1\nx,y,9,\n')
    rows = list(parse("pairs", detect_format("pairs", path), path))
    assert rows[0]["text1"] == "a, b" and rows[0]["label"] == 2 and rows[0]["similarity"] == pytest.approx(0.1)
    assert rows[1]["line"] == 3 and "unknown label '9'" in rows[1]["error"]


def test_parquet_pairs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text1": ["a", "b"], "text2": ["c", ""], "label": [0, 1]}), path)
    rows = list(parse("pairs", detect_format("pairs", path), path))
    assert rows[0]["error"] is None and rows[1]["error"] == "field 'text2' is empty" and rows[1]["line"] == 2


def test_senteval_nli_layout(tmp_path):
    write(tmp_path / "s1.dev", "a man sleeps\na dog runs\n")
    write(tmp_path / "s2.dev", "a person rests\na cat runs\n")
    write(tmp_path / "labels.dev", "entailment\ncontradiction\n")
    rows = list(parse("pairs", "senteval_nli", tmp_path, "dev"))
    assert [(r["text2"], r["label"], r["line"]) for r in rows] == [("a person rests", 0, 1), ("a cat runs", 2, 2)]


def test_sts_csv_scores_become_similarity_over_5(tmp_path):
    path = write(tmp_path / "stsb-en-train.csv", 'A plane.,"A plane, flying.",4.2\na,b,7\n')
    rows = list(parse("sts", detect_format("sts", path), path))
    assert rows[0]["text2"] == "A plane, flying." and rows[0]["similarity"] == pytest.approx(0.84)
    assert "score must be a number in [0, 5]" in rows[1]["error"]


def test_sentences_ranked_lists_and_triples(tmp_path):
    txt = write(tmp_path / "wiki.txt", "first sentence\n\nsecond sentence\n")
    got = [(r["text"], r["line"]) for r in parse("sentences", "txt", txt)]
    assert got == [("first sentence", 1), ("second sentence", 3)]
    lists = write(tmp_path / "l.jsonl", '{"sentences": ["seed", "near", "far"]}\n{"sentences": ["only"]}\n')
    out = list(parse("lists", "jsonl", lists))
    assert out[0]["sentences"] == ["seed", "near", "far"] and "at least 2" in out[1]["error"]
    triples = write(tmp_path / "t.jsonl", '{"head": "a", "tail": "b", "relation": "entailment"}\n{"head": "a"}\n')
    out = list(parse("triples", "jsonl", triples))
    assert out[0]["relation"] == "entailment" and out[1]["error"] == "missing field 'tail'"


def test_real_senteval_snli_and_stsb_files(dev_data):
    rows = list(parse("pairs", "senteval_nli", dev_data / "snli", "test"))
    assert len(rows) == 9824 and all(r["error"] is None for r in rows)
    assert {r["label"] for r in rows} == {0, 1, 2}
    sts = list(parse("sts", "stsb_csv", dev_data / "stsb" / "stsb-en-dev.csv"))
    assert len(sts) == 1500 and all(r["error"] is None for r in sts)
    senteval = list(parse("sts", "senteval_sts", dev_data / "senteval" / "STS" / "STSBenchmark" / "sts-dev.csv"))
    assert len(senteval) == 1500 and senteval[0]["score"] == 5.0


@pytest.mark.parametrize("target, chunk", [(1, 64), (300, 64), (4096, 1000), (1 << 20, 8 << 20)])
def test_a_file_read_as_spans_gives_every_record_with_its_own_line_number(tmp_path, target, chunk):
    """A large file is read as many spans in parallel: together they give exactly the whole file's records, bad
    ones named by the file's line numbers, whatever the span and read-chunk sizes (BOM, CRLF, blank lines, bad
    UTF-8 and a missing final newline included)."""
    import random

    from data_pipelines.formats import file_spans

    rng = random.Random(0)
    lines = [b"\xff\xfe not utf-8" if rng.random() < 0.03 else b"{broken" if rng.random() < 0.03 else b"  "
             if rng.random() < 0.03 else json.dumps({"text1": "a" * rng.randint(1, 90), "text2": "b", "label": 0,
                                                    "similarity": 0.5}).encode() for _ in range(600)]
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(lines))
    whole = list(parse("pairs", "pairs_jsonl", path))
    spans = file_spans(path, target, chunk_bytes=chunk)
    assert spans[0].start == 0 and spans[-1].end == path.stat().st_size
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert [r for s in spans for r in parse("pairs", "pairs_jsonl", path, span=s)] == whole
    assert len(spans) > 1 or target >= path.stat().st_size
    assert sum(r["error"] is not None for r in whole) > 20  # the bad lines are there, numbered as in the file


def test_triplets_jsonl_reads_query_positive_rows_with_or_without_a_negative(tmp_path):
    """Mining's input ({query, positive}) and output ({text1, text2, negative}) in one kind; a negative equal to the
    positive is a bad row that names its line."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"query": "q one", "positive": "p one"}\n'
                    '{"text1": "q two", "text2": "p two", "negative": "n two"}\n'
                    '{"anchor": "q three", "positive": "same", "negative": "same"}\n'
                    '{"query": "q four"}\n')
    assert detect_format("triplets", path) == "triplets_jsonl"
    rows = list(parse("triplets", "triplets_jsonl", path))
    assert [(r["text1"], r["text2"], r["text_neg"]) for r in rows[:2]] == [("q one", "p one", None),
                                                                           ("q two", "p two", "n two")]
    assert rows[0]["label"] == 0 and math.isnan(rows[0]["similarity"])
    assert rows[2]["line"] == 3 and "equals the positive" in rows[2]["error"]
    assert rows[3]["line"] == 4 and "missing field 'text2'" in rows[3]["error"]
