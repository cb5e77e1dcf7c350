"""Sentence corpora (Wiki1M-style): one sentence per line, JSON lines with text (+ SAN negative), Parquet, and
the distinct sentences of a SentEval NLI folder; bad lines named by file:line or quarantined, none lost."""

import json
from pathlib import Path

import pytest

from data_pipelines.formats import detect_format, parse
from data_pipelines.readers import BadDataError, load_corpus

SNLI = Path(__file__).resolve().parents[3] / "shared" / "data" / "snli"


def _parsed(kind, fmt, path, split=None):
    return list(parse(kind, fmt, path, split))


def test_one_sentence_per_line_with_bad_lines_named(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_bytes(b"A man plays a guitar.\r\n\n...!!\n\xff\xfe broken\nThe cat sleeps\n")
    rows = _parsed("sentences", detect_format("sentences", path), path)
    good = [r["text"] for r in rows if r["error"] is None]
    assert good == ["A man plays a guitar.", "The cat sleeps"]  # CRLF and no final newline accepted
    bad = {r["line"]: r["error"] for r in rows if r["error"]}
    assert "only punctuation" in bad[3] and "invalid UTF-8" in bad[4] and set(bad) == {3, 4}


def test_json_lines_carry_an_optional_aligned_negative(tmp_path):
    path = tmp_path / "san.jsonl"
    lines = [{"text": "a dog runs.", "negative": "a dog sleeps."}, {"text": "kids play."},
             {"text": "a cat eats.", "negative": "a cat eats."}, {"text": "x y", "negative": 3}, {"text": ""}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rows = _parsed("sentences", "jsonl", path)
    assert [(r["text"], r["negative"]) for r in rows[:2]] == [("a dog runs.", "a dog sleeps."), ("kids play.", None)]
    assert "equals the sentence" in rows[2]["error"] and "must be text" in rows[3]["error"]
    assert "empty" in rows[4]["error"]


def test_fail_and_quarantine_account_for_every_line(ray_local, tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text("one sentence.\n???\ntwo sentences.\n")
    with pytest.raises(BadDataError, match=f"{path}:2: field 'text' holds only punctuation"):
        load_corpus("sentences", path)
    ds, report = load_corpus("sentences", path, on_bad_record="quarantine", quarantine_path=tmp_path / "q.jsonl")
    assert (report.rows_in, report.rows_written, report.rows_quarantined) == (3, 2, 1)
    assert sorted(r["text"] for r in ds.take_all()) == ["one sentence.", "two sentences."]


@pytest.mark.skipif(not SNLI.exists(), reason="needs ../shared/data/snli (the development corpus)")
def test_an_nli_folder_gives_its_distinct_sentences():
    rows = _parsed("sentences", detect_format("sentences", SNLI), SNLI, "dev")
    texts = [r["text"] for r in rows if r["error"] is None]
    premises = (SNLI / "s1.dev").read_text().splitlines()
    hypotheses = (SNLI / "s2.dev").read_text().splitlines()
    assert len(texts) == len(set(texts)) == len(set(premises) | set(hypotheses))
    assert texts[0] == premises[0] and len(set(premises)) < len(premises)  # premises repeat in SNLI
