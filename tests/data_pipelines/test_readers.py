"""The Ray layer: validated datasets, fail vs quarantine, counts, and disjoint covering shards."""

import json
import threading

import pytest

from data_pipelines.readers import BadDataError, load_corpus


def corpus(tmp_path, bad=True):
    rows = [json.dumps({"text1": f"s{i}", "text2": f"t{i}", "label": i % 3, "similarity": i / 40}) for i in range(40)]
    if bad:
        rows[5] = '{"text1": "", "text2": "x", "label": 0}'
        rows[17] = '{"text1": "a", "text2": "b", "label": "unsure"}'
        rows[30] = "not json"
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_fail_mode_names_every_bad_record_by_file_and_line(ray_local, tmp_path):
    path = corpus(tmp_path)
    with pytest.raises(BadDataError) as exc:
        load_corpus("pairs", path)
    text = str(exc.value)
    assert "3 bad record(s)" in text
    assert f"{path}:6: field 'text1' is empty" in text
    assert f"{path}:18: unknown label 'unsure'" in text
    assert f"{path}:31: invalid JSON" in text


def test_quarantine_mode_keeps_good_rows_and_writes_bad_ones(ray_local, tmp_path):
    path = corpus(tmp_path)
    ds, report = load_corpus("pairs", path, on_bad_record="quarantine", quarantine_path=tmp_path / "q" / "bad.jsonl")
    assert (report.rows_in, report.rows_written, report.rows_quarantined) == (40, 37, 3)
    assert ds.count() == 37 and set(ds.schema().names) == {"text1", "text2", "label", "similarity"}
    bad = [json.loads(line) for line in open(report.quarantine_path)]
    assert sorted(b["line"] for b in bad) == [6, 18, 31]
    assert all(b["source"] == str(path) and b["reason"] and b["raw"] for b in bad)


def test_max_rows_and_a_clean_corpus(ray_local, tmp_path):
    ds, report = load_corpus("pairs", corpus(tmp_path, bad=False), max_rows=25)
    assert ds.count() == 25 and report.rows_quarantined == 0 and report.quarantine_path is None


def test_shuffle_seed_gives_a_fair_reproducible_sample(ray_local, tmp_path):
    path = corpus(tmp_path, bad=False)
    head = [r["text1"] for r in load_corpus("pairs", path, max_rows=10)[0].take_all()]
    first = [r["text1"] for r in load_corpus("pairs", path, max_rows=10, shuffle_seed=3)[0].take_all()]
    again = [r["text1"] for r in load_corpus("pairs", path, max_rows=10, shuffle_seed=3)[0].take_all()]
    assert head == [f"s{i}" for i in range(10)]
    assert first == again and sorted(first) != sorted(head)  # same seed, same sample; not the first rows
    everything = load_corpus("pairs", path, shuffle_seed=3)[0].take_all()
    assert sorted(r["text1"] for r in everything) == sorted(f"s{i}" for i in range(40))


def test_two_streaming_shards_are_disjoint_and_cover_the_data(ray_local, tmp_path):
    ds, _ = load_corpus("pairs", corpus(tmp_path, bad=False))
    shards = ds.streaming_split(2, equal=False)  # what Ray Train hands each worker
    seen = [[], []]

    def consume(i):
        for batch in shards[i].iter_batches(batch_size=8, batch_format="pandas"):
            seen[i].extend(batch["text1"].tolist())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(f"s{i}" for i in range(40))


def test_real_snli_dev_reads_through_ray(ray_local, dev_data):
    ds, report = load_corpus("pairs", dev_data / "snli", split="dev")
    assert report.format == "senteval_nli" and report.rows_in == 9842 == ds.count()
