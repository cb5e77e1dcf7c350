"""Bad input, kind by kind: at least ten kinds of bad rows each, every one named with its file and line (fail) or
quarantined with its reason (quarantine), none lost, the counts adding up; and what must be accepted: a UTF-8 byte
order mark, CRLF line ends, no final newline, extra unknown columns (ignored: only the kind's fields are kept)."""

import json

import pytest

from data_pipelines.formats import FIELDS, parse
from data_pipelines.readers import BadDataError, load_corpus

NON_UTF8 = b'{"text": "caf\xe9 \xff"}'
JSON_COMMON = [  # (line, reason fragment) for every JSON-lines kind
    (b'{"text1": "a man", "te', "invalid JSON"),
    (b'["a", "b"]', "expected a JSON object, got list"),
    (NON_UTF8, "invalid UTF-8"),
    (b"42", "expected a JSON object, got int"),
]
BAD = {
    "pairs": ("pairs_jsonl", '{"text1": "a man sits", "text2": "a person sits", "label": "entailment", '
              '"similarity": 0.9, "extra": "ignored"}', JSON_COMMON + [
        (b'{"text1": "", "text2": "b", "label": 0}', "field 'text1' is empty"),
        (b'{"text1": "   ", "text2": "b", "label": 0}', "field 'text1' is empty"),
        (b'{"text1": 7, "text2": "b", "label": 0}', "field 'text1' must be text"),
        (b'{"text1": "a", "label": 0}', "missing field 'text2'"),
        (b'{"text1": "a", "text2": "b", "label": "maybe"}', "unknown label 'maybe'"),
        (b'{"text1": "a", "text2": "b", "label": 7}', "unknown label 7"),
        (b'{"text1": "a", "text2": "b", "label": 0, "similarity": NaN}', "must be a number in [0, 1]"),
        (b'{"text1": "a", "text2": "b", "label": 0, "similarity": Infinity}', "must be a number in [0, 1]"),
        (b'{"text1": "a", "text2": "b", "label": 0, "similarity": 1.5}', "must be a number in [0, 1]"),
        (b'{"text1": "a", "text2": "b", "label": 0, "similarity": "high"}', "must be a number in [0, 1]"),
    ]),
    "sts": ("stsb_csv", '"A plane is taking off.","An air plane is taking off.",5.0', [
        (b'"A plane","A jet"', "expected 3 fields, got 2"),
        (b'"A plane","A jet",4.0,extra', "expected 3 fields, got 4"),
        (b'"","A jet",4.0', "is empty"),
        (b'"   ","A jet",4.0', "is empty"),
        (b'"A plane","A jet",high', "score must be a number in [0, 5]"),
        (b'"A plane","A jet",7', "score must be a number in [0, 5]"),
        (b'"A plane","A jet",-1', "score must be a number in [0, 5]"),
        (b'"A plane","A jet",nan', "score must be a number in [0, 5]"),
        (b'"A plane","A jet",inf', "score must be a number in [0, 5]"),
        (b'"A plane \xff","A jet",4.0', "invalid UTF-8"),
    ]),
    "sentences": ("jsonl", '{"text": "A man plays a guitar.", "source_url": "ignored"}', JSON_COMMON + [
        (b'{"text": ""}', "field 'text' is empty"),
        (b'{"text": "  \\t "}', "field 'text' is empty"),
        (b'{"text": 3}', "field 'text' must be text"),
        (b'{"sentence": "wrong key"}', "missing field 'text'"),
        (b'{"text": "...!!"}', "only punctuation"),
        (b'{"text": "A man sits.", "negative": "A man sits."}', "equals the sentence itself"),
        (b'{"text": "A man sits.", "negative": 5}', "field 'negative' must be text"),
    ]),
    "lists": ("jsonl", '{"sentences": ["a man sits.", "a man is seated.", "a dog runs."], "id": 1}', JSON_COMMON + [
        (b'{"sentences": ["only one"]}', "at least 2 sentences"),
        (b'{"sentences": []}', "at least 2 sentences"),
        (b'{"sentences": "a man sits. a dog runs."}', "must be a list of at least 2"),
        (b'{"sentences": ["a man sits.", ""]}', "sentence 1 of 'sentences' is empty"),
        (b'{"sentences": ["a man sits.", "   "]}', "sentence 1 of 'sentences' is empty"),
        (b'{"sentences": ["a man sits.", 3]}', "sentence 1 of 'sentences' is empty or not text"),
        (b'{"list": ["a", "b"]}', "must be a list of at least 2"),
    ]),
    "triples": ("jsonl", '{"head": "a man sits.", "tail": "a person sits.", "relation": "entailment", "src": 1}',
                JSON_COMMON + [
        (b'{"head": "a man sits.", "tail": "a person sits.", "relation": "entailment", "negative": "a person sits."}',
         "equals the tail"),
        (b'{"head": "", "tail": "b", "relation": "entailment"}', "field 'head' is empty"),
        (b'{"head": "a", "tail": "  ", "relation": "entailment"}', "field 'tail' is empty"),
        (b'{"head": "a", "relation": "entailment"}', "missing field 'tail'"),
        (b'{"head": "a", "tail": "b", "relation": ""}', "field 'relation' is empty"),
        (b'{"head": "a", "tail": "b", "relation": 3}', "field 'relation' must be text"),
        (b'{"head": "a", "tail": "...", "relation": "entailment"}', "only punctuation"),
        (b'{"head": 1, "tail": "b", "relation": "entailment"}', "field 'head' must be text"),
    ]),
}


def corpus(tmp_path, kind):
    """good, bad..., good lines: a BOM before the first, CRLF ends, no final newline."""
    fmt, good, bad = BAD[kind]
    lines = [good.encode()] + [line for line, _ in bad] + [good.encode()]
    path = tmp_path / f"{kind}.{'csv' if fmt == 'stsb_csv' else 'jsonl'}"
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(lines))
    return path, fmt, bad


@pytest.mark.parametrize("kind", sorted(BAD))
def test_every_bad_row_is_named_and_what_must_be_accepted_is(tmp_path, kind):
    path, fmt, bad = corpus(tmp_path, kind)
    assert len(bad) >= 10
    rows = list(parse(kind, fmt, path))
    assert len(rows) == len(bad) + 2  # none lost
    first, *middle, last = rows
    assert first["error"] is None and last["error"] is None, (first, last)  # BOM, CRLF, no final newline
    assert set(FIELDS[kind]) <= set(first) and "extra" not in first and "src" not in first  # unknown columns ignored
    for row, (line, reason) in zip(middle, bad):
        assert row["error"] is not None and reason in row["error"], (line, row["error"])
        assert row["line"] == rows.index(row) + 1


@pytest.mark.parametrize("kind", ["sts", "triples"])
def test_fail_names_file_and_line_and_quarantine_counts_add_up(ray_local, tmp_path, kind):
    path, fmt, bad = corpus(tmp_path, kind)
    with pytest.raises(BadDataError) as caught:
        load_corpus(kind, path, fmt=fmt)
    assert f"{len(bad)} bad record(s)" in str(caught.value) and f"{path}:2: " in str(caught.value)
    ds, report = load_corpus(kind, path, fmt=fmt, on_bad_record="quarantine", quarantine_path=tmp_path / "q.jsonl")
    assert (report.rows_in, report.rows_written, report.rows_quarantined) == (len(bad) + 2, 2, len(bad))
    assert ds.count() == 2
    quarantined = [json.loads(x) for x in open(report.quarantine_path)]
    assert sorted(q["line"] for q in quarantined) == list(range(2, len(bad) + 2))
    assert all(q["reason"] and q["source"] == str(path) for q in quarantined)


def test_a_file_of_many_bad_rows_fails_with_a_count_and_its_first_rows_in_file_order(ray_local, tmp_path,
                                                                                     monkeypatch):
    """Every task counts its bad rows and sends at most 20 of them (messages cut to 300 characters), so a wrong
    field name in a huge file is a clean error, not the driver holding every row: 150 bad rows read by many tasks."""
    from data_pipelines import readers

    monkeypatch.setattr(readers, "SPAN_BYTES", 2000)  # about 10 lines a task
    path = tmp_path / "pairs.jsonl"
    rows = [{"text1": f"a premise {i}", "text2": f"a hypothesis {i}", "label": "entailment"} for i in range(50)]
    rows += [{"text1": f"premise {i}", "text2": f"hypothesis {i}", "label": "x" * 1000} for i in range(150)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BadDataError) as caught:
        load_corpus("pairs", path)
    message = str(caught.value)
    named = [int(line.split(":")[1]) for line in message.splitlines() if line.startswith(f"  {path}:")]
    assert "150 bad record(s)" in message and named == list(range(51, 71)) and "... and 130 more" in message
    assert "unknown label" in message and max(map(len, message.splitlines())) < 300 + len(str(path)) + 20
    ds, report = load_corpus("pairs", path, on_bad_record="quarantine", quarantine_path=tmp_path / "q.jsonl")
    quarantined = [json.loads(x) for x in open(report.quarantine_path)]
    assert report.rows_quarantined == len(quarantined) == 150 and ds.count() == 50
    assert sorted(q["line"] for q in quarantined) == list(range(51, 201))
    assert all(len(q["raw"]) > 1000 for q in quarantined)  # the quarantine keeps the whole row
