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


def test_max_rows_keeps_the_first_rows_in_file_order_whichever_read_task_finishes_first(ray_local, tmp_path):
    """data.max_rows takes the same rows every run (a resubmitted run must continue on the rows it started on): a
    folder whose first file is long (one slow read task) and whose second holds three lines (a fast task) gives the
    first file's first rows, not the rows of the task that finished first."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text1": f"s{i}", "text2": f"t{i}", "label": i % 3}) + "\n"
                                            for i in range(60000)))
    (folder / "b.jsonl").write_text("".join(json.dumps({"text1": f"late{i}", "text2": "t", "label": 0}) + "\n"
                                            for i in range(3)))
    for _ in range(2):
        ds, report = load_corpus("pairs", folder, max_rows=3)
        assert sorted(r["text1"] for r in ds.take_all()) == ["s0", "s1", "s2"] and report.rows_in == 3
        assert not ds.context.execution_options.preserve_order  # what is built on the subset runs unordered


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


def test_a_large_parquet_file_is_read_by_row_groups_in_many_tasks(ray_local, tmp_path, monkeypatch):
    """A Parquet file is cut between its row groups (never one task holding a multi-GB file as Python dicts): the
    rows and the bad rows' numbers are those of a whole-file read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import data_pipelines.readers as readers
    from data_pipelines.formats import parquet_spans

    rows = [{"text1": f"premise {i}", "text2": f"hypothesis {i}", "label": "bad" if i in (7, 33) else "neutral"}
            for i in range(60)]
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=8)
    whole, whole_report = load_corpus("pairs", path, on_bad_record="quarantine", quarantine_path=tmp_path / "a.jsonl")
    spans = parquet_spans(path, 1)  # every row group a span of its own
    assert [(s.start, s.end, s.first_line) for s in spans] == [(g, g + 1, 8 * g + 1) for g in range(8)]
    monkeypatch.setattr(readers, "SPAN_BYTES", 1)
    raw, _, _ = readers.read_raw("pairs", path)
    assert raw.materialize().num_blocks() == 8
    split, split_report = load_corpus("pairs", path, on_bad_record="quarantine", quarantine_path=tmp_path / "b.jsonl")
    assert sorted(map(json.dumps, split.take_all())) == sorted(map(json.dumps, whole.take_all()))
    lines = [sorted(json.loads(x)["line"] for x in open(r.quarantine_path)) for r in (whole_report, split_report)]
    assert lines[0] == lines[1] == [8, 34] and split_report.rows_written == 58


def test_real_snli_dev_reads_through_ray(ray_local, dev_data):
    ds, report = load_corpus("pairs", dev_data / "snli", split="dev")
    assert report.format == "senteval_nli" and report.rows_in == 9842 == ds.count()


def csv_corpus(tmp_path):
    """corpus()'s rows as CSV with a header line: the same three bad rows, one line further down."""
    rows = [f"s{i},t{i},{i % 3},{i / 40}" for i in range(40)]
    rows[5], rows[17], rows[30] = ",x,0,", "a,b,unsure,", "only two,fields"
    path = tmp_path / "pairs.csv"
    path.write_text("text1,text2,label,similarity\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("layout", ["jsonl", "csv with a header"])
def test_a_large_file_is_read_as_many_tasks_with_the_same_rows_and_bad_lines(ray_local, tmp_path, monkeypatch, layout):
    """One file becomes one read task per span (data_pipelines.readers.SPAN_BYTES), so a 100M-line corpus is not
    one task: the validated rows and the named bad lines are those of a whole-file read (a CSV's spans each read
    the header from the file's head)."""
    import data_pipelines.readers as readers

    path = corpus(tmp_path) if layout == "jsonl" else csv_corpus(tmp_path)
    whole, whole_report = load_corpus("pairs", path, on_bad_record="quarantine", quarantine_path=tmp_path / "a.jsonl")
    monkeypatch.setattr(readers, "SPAN_BYTES", 200 if layout == "jsonl" else 60)  # about 3 lines a task
    raw, _, _ = readers.read_raw("pairs", path)
    assert raw.materialize().num_blocks() >= 8  # one per span of ~3 lines: 40 lines
    split, split_report = load_corpus("pairs", path, on_bad_record="quarantine", quarantine_path=tmp_path / "b.jsonl")
    assert sorted(map(json.dumps, split.take_all())) == sorted(map(json.dumps, whole.take_all()))
    assert split_report.rows_written == whole_report.rows_written == 37
    lines = [sorted(json.loads(x)["line"] for x in open(r.quarantine_path)) for r in (whole_report, split_report)]
    assert lines[0] == lines[1] == ([6, 18, 31] if layout == "jsonl" else [7, 19, 32])


def test_a_validated_corpus_is_read_back_from_the_cache_until_its_files_change(ray_local, tmp_path):
    """A sweep trial or a resubmission over the same files skips parsing and validation: the rows, the counts and
    the quarantined lines come back from Parquet; a changed file is validated again."""
    path, cache = corpus(tmp_path), tmp_path / "cache"
    options = {"on_bad_record": "quarantine", "cache_dir": cache}
    first, first_report = load_corpus("pairs", path, quarantine_path=tmp_path / "q1.jsonl", **options)
    again, again_report = load_corpus("pairs", path, quarantine_path=tmp_path / "q2.jsonl", **options)
    assert (first_report.cache, again_report.cache) == ("written", "read")
    assert sorted(map(json.dumps, again.take_all())) == sorted(map(json.dumps, first.take_all()))
    counts = lambda r: (r.rows_in, r.rows_written, r.rows_quarantined)  # noqa: E731
    assert counts(again_report) == counts(first_report) == (40, 37, 3)
    assert again_report.quarantine_path == str((tmp_path / "q2.jsonl").resolve())
    assert [json.loads(x)["line"] for x in open(again_report.quarantine_path)] == [6, 18, 31]
    other_key = load_corpus("pairs", path, max_rows=10, quarantine_path=tmp_path / "q4.jsonl", **options)[1]
    assert other_key.cache == "written"  # another key: its own entry
    path.write_text(path.read_text().replace('"s1"', '"changed"'))
    changed, changed_report = load_corpus("pairs", path, quarantine_path=tmp_path / "q3.jsonl", **options)
    assert changed_report.cache == "written" and "changed" in {r["text1"] for r in changed.take_all()}


def test_the_cache_removes_killed_attempts_after_a_day_and_least_recently_used_entries_above_its_size(tmp_path):
    import os
    import time

    from data_pipelines.corpus_cache import LAST_USED, tidy

    now = time.time()

    def put(name: str, size: int, age_s: float):
        path = tmp_path / "cache" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        os.utime(path, (now - age_s, now - age_s))

    for entry, used_ago in (("a", 3000), ("b", 1000), ("c", 2000)):  # all beyond the grace of an entry in use
        put(f"{entry}/1/rows/part.parquet", 100, used_ago)
        put(f"{entry}/1/report.json", 0, used_ago)
        put(f"{entry}/{LAST_USED}", 0, used_ago)
    put("b/2/rows/part.parquet", 1000, 2 * 86400)  # a killed writer's, two days ago
    put("c/3/rows/part.parquet", 1000, 3600)  # perhaps still writing
    put("a/4/report.json", 0, 3 * 86400)  # committed long ago (a second committed attempt): kept
    removed = tidy(tmp_path / "cache", max_gb=1250e-9, keep="a", now=now)
    # c (1,200 bytes) is used less recently than b; a, used least recently of all, is the one in use
    assert removed == ["b/2 (never committed, 48 h old)",
                       "c (0.000 GB, least recently used; data.cache_max_gb=1.25e-06)"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["a", "b"]
    assert (tmp_path / "cache" / "a" / "4").exists() and not (tmp_path / "cache" / "b" / "2").exists()
    assert tidy(tmp_path / "cache", max_gb=None, now=now + 365 * 86400) == []  # no limit: committed entries stay
    put(f"b/{LAST_USED}", 0, 60)  # another run read b a minute ago, and may still be reading it
    assert tidy(tmp_path / "cache", max_gb=0, keep="a", now=now) == []  # over the limit, but b is in use


def _cached_corpus(tmp_path):
    """A corpus with bad rows, validated once into the cache: (path, cache folder, the load options)."""
    path, cache = corpus(tmp_path), tmp_path / "cache"
    options = {"on_bad_record": "quarantine", "cache_dir": cache, "quarantine_path": tmp_path / "q.jsonl"}
    assert load_corpus("pairs", path, **options)[1].cache == "written"
    return path, cache, options


def test_a_torn_report_is_a_miss_not_a_failure_of_every_later_run_and_goes_after_a_day(ray_local, tmp_path):
    """A writer killed while writing report.json once left half of it: every later run on the corpus failed with
    JSONDecodeError, and the housekeeping never removed it. Reports are now written whole, and an unreadable one
    commits nothing."""
    import time

    from data_pipelines.corpus_cache import _committed

    path, cache, options = _cached_corpus(tmp_path)
    [report] = list(cache.glob("*/*/report.json"))
    report.write_text(report.read_text()[:40])  # torn
    ds, again = load_corpus("pairs", path, **options)
    assert again.cache == "written" and ds.count() == 37  # validated again, and cached again
    assert load_corpus("pairs", path, **options)[1].cache == "read"
    entry = report.parent.parent
    assert _committed(entry) and report.exists()  # within a day it stays (a writer may be that slow)
    assert len(_committed(entry, now=time.time() + 2 * 86400)) == 1 and not report.parent.exists()
    assert not list(cache.glob("*/*/.report.json.*"))  # the new report's staging file was renamed into place


def test_the_quarantine_file_is_streamed_never_read_whole_into_the_driver(ray_local, tmp_path, monkeypatch):
    """The cache copied quarantine.jsonl with ``write_bytes(read_bytes())`` on every write and read: a quarantine
    of many GB passed through the driver's memory whole."""
    from pathlib import Path

    read_bytes = Path.read_bytes

    def whole(self):
        assert self.suffix != ".jsonl", f"{self} read whole into memory"
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", whole)
    path, cache, options = _cached_corpus(tmp_path)
    report = load_corpus("pairs", path, **{**options, "quarantine_path": tmp_path / "q2.jsonl"})[1]
    assert report.cache == "read" and [json.loads(x)["line"] for x in open(report.quarantine_path)] == [6, 18, 31]


def test_an_entry_is_marked_in_use_before_its_read_so_another_run_cannot_evict_it_meanwhile(ray_local, tmp_path,
                                                                                          monkeypatch):
    """The entry's last use was written after ``read_cached`` returned: another run's housekeeping, between the
    two, saw it unused (for days, in a sweep's first trial) and removed the files being read."""
    import os
    import time

    import data_pipelines.corpus_cache as corpus_cache

    path, cache, options = _cached_corpus(tmp_path)
    long_ago = time.time() - 30 * 86400
    for file in cache.rglob("*"):
        os.utime(file, (long_ago, long_ago))
    read_rows = corpus_cache._read_rows

    def read_while_another_run_tidies(rows_folder):
        assert corpus_cache.tidy(cache, max_gb=0) == []  # another run over its own corpus, over the limit
        return read_rows(rows_folder)

    monkeypatch.setattr(corpus_cache, "_read_rows", read_while_another_run_tidies)
    ds, report = load_corpus("pairs", path, **options)
    assert report.cache == "read" and ds.count() == 37


def test_two_runs_caching_the_same_corpus_at_once_never_mix_their_files(ray_local, tmp_path):
    """Concurrent sweep trials validate the same files: each writes an attempt folder of its own, committed by its
    report written last, and a reader takes the first committed whole (a shared folder once held both: 256 rows of
    128). An attempt without its report (a killed writer) or whose files are not those its report lists is not
    read; a write that cannot be made is a warning, not a failed run."""
    import ray

    from data_pipelines.corpus_cache import read_cached, write_cached

    folder = tmp_path / "cache" / "key"
    first, second = (ray.data.from_items([{"text": f"{tag}{i}"} for i in range(20)]) for tag in ("a", "b"))
    assert write_cached(folder, first, {"rows_written": 20})
    assert write_cached(folder, second, {"rows_written": 20})  # committed second: the first is read
    ds, report = read_cached(folder, None)
    assert sorted(r["text"] for r in ds.take_all()) == sorted(f"a{i}" for i in range(20))
    assert report["rows_written"] == 20 and [p.name for p in folder.parent.iterdir()] == ["key"]
    attempts = sorted((r.parent for r in folder.glob("*/report.json")),
                      key=lambda a: json.loads((a / "report.json").read_text())["committed_at"])
    (attempts[1] / "report.json").unlink()  # the second writer was killed before its commit
    next((attempts[0] / "rows").iterdir()).unlink()  # and the first lost a file
    assert read_cached(folder, None) is None
    (tmp_path / "read-only").write_text("a file where the cache folder should be")
    assert not write_cached(tmp_path / "read-only" / "key", first, {"rows_written": 20})


def test_a_cached_corpus_is_read_without_footer_actors_or_columns_from_its_path(ray_local, tmp_path, monkeypatch):
    """A warm job reads its cached corpus with Ray Data's V1 Parquet reader: Ray 2.60's default (DataSourceV2) starts
    FooterReader actors on every read, 2-3 s of each warm start here. A ``key=value`` folder of the storage path
    is not a column of the corpus (the default Hive partitioning made it one), and every other read keeps Ray's
    default reader."""
    import ray

    from data_pipelines.corpus_cache import read_cached, write_cached

    monkeypatch.setattr(ray.data.DataContext.get_current(), "use_datasource_v2", True)  # Ray 2.60's default
    folder = tmp_path / "day=2026-11-28" / "cache" / "key"
    assert write_cached(folder, ray.data.from_items([{"text": f"t{i}"} for i in range(12)]), {"rows_written": 12})
    ds, _ = read_cached(folder, None)
    stats = ds.stats()
    assert "ReadParquet" in stats and "ListFiles" not in stats and ray.data.DataContext.get_current().use_datasource_v2
    assert ds.columns() == ["text"] and sorted(r["text"] for r in ds.take_all()) == sorted(f"t{i}" for i in range(12))
