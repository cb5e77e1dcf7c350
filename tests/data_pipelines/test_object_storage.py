"""Corpora on object storage (storage.paths) read exactly as the same files on disk, by the Ray Data tasks, on the
tests' local S3 endpoint: every layout (a file read in spans, Parquet, a folder of files, a SentEval NLI folder),
bad records named by their URI and line, and the corpus cache keyed by the object's content (its ETag)."""

import json
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_pipelines.formats as formats
import data_pipelines.readers as readers
from data_pipelines.readers import BadDataError, load_corpus
from storage.paths import is_uri, storage_path


def _pairs(count: int, bad_line: int | None = None) -> str:
    rows = [json.dumps({"text1": f"premise {i}", "text2": f"hypothesis {i}", "label": i % 3, "similarity": i / count})
            for i in range(count)]
    if bad_line is not None:
        rows[bad_line - 1] = '{"text1": "a", "text2": "b", "label": "unsure"}'
    return "\n".join(rows) + "\n"


def _layouts(root):
    """Local corpora of every layout: name -> (kind, path)."""
    (root / "spans.jsonl").write_text(_pairs(60))
    pq.write_table(pa.Table.from_pylist([{"text": f"sentence {i}"} for i in range(25)]), root / "sentences.parquet")
    folder = root / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text(_pairs(7))
    (folder / "b.jsonl").write_text(_pairs(9))
    senteval = root / "senteval"
    senteval.mkdir()
    (senteval / "s1.train").write_text("".join(f"premise {i}\n" for i in range(6)))
    (senteval / "s2.train").write_text("".join(f"hypothesis {i}\n" for i in range(6)))
    (senteval / "labels.train").write_text("".join(f"{('entailment', 'neutral', 'contradiction')[i % 3]}\n"
                                                   for i in range(6)))
    return {"spans": ("pairs", root / "spans.jsonl"), "parquet": ("sentences", root / "sentences.parquet"),
            "folder": ("pairs", folder), "senteval": ("pairs", senteval)}


def _rows(kind, path, **options):
    ds, report = load_corpus(kind, path, split="train", **options)
    return sorted(json.dumps(r, sort_keys=True) for r in ds.take_all()), report


def test_every_layout_on_s3_reads_the_rows_of_the_same_files_on_disk(s3, tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "SPAN_BYTES", 1024)  # the 60-row file is read as several spans, in several tasks
    for name, (kind, local) in _layouts(tmp_path).items():
        uri = s3.upload(local, f"corpora/{name}" + (local.suffix if local.is_file() else ""))
        on_disk, local_report = _rows(kind, local)
        on_s3, report = _rows(kind, uri)
        assert on_s3 == on_disk and len(on_s3) == local_report.rows_written > 0, name
        assert report.format == local_report.format and all(f.startswith(uri) for f in report.files), name
    assert len(formats.file_spans(storage_path(s3.uri("corpora/spans.jsonl")), 1024)) > 2


def test_a_bad_record_on_s3_is_named_by_its_uri_and_line(s3, tmp_path):
    local = tmp_path / "pairs.jsonl"
    local.write_text(_pairs(12, bad_line=8))
    uri = s3.upload(local, "bad/pairs.jsonl")
    with pytest.raises(BadDataError) as failed:
        load_corpus("pairs", uri)
    assert f"{uri}:8: unknown label 'unsure'" in str(failed.value)
    ds, report = load_corpus("pairs", uri, on_bad_record="quarantine", quarantine_path=tmp_path / "q.jsonl")
    assert (report.rows_in, report.rows_written, report.rows_quarantined) == (12, 11, 1) and ds.count() == 11
    assert [json.loads(line)["source"] for line in (tmp_path / "q.jsonl").read_text().splitlines()] == [uri]


def test_the_corpus_cache_on_s3_reads_an_unchanged_object_back_and_revalidates_a_rewritten_one(s3, tmp_path,
                                                                                              monkeypatch):
    """The cache itself on object storage (as under an s3:// trainer.storage_path), its Parquet written by the
    tasks; the key holds the object's ETag (an MD5 of its content on S3): a rewritten object of the same size and
    name is validated again, not served from the cache. With data.cache_max_gb a write removes the least recently used
    entries, never the one in use; an attempt a killed run left is removed once a day old. (No grace for entries
    used minutes ago here: tests/data_pipelines/test_readers.py has its test.)"""
    from data_pipelines.corpus_cache import tidy
    from storage import in_use

    monkeypatch.setattr(in_use, "GRACE_S", 0)

    local = tmp_path / "pairs.jsonl"
    local.write_text(_pairs(10))
    uri = s3.upload(local, "cached/pairs.jsonl")
    cache = s3.uri("runs/corpus_cache")
    first, written = _rows("pairs", uri, cache_dir=cache)
    again, read = _rows("pairs", uri, cache_dir=cache)
    assert (written.cache, read.cache) == ("written", "read") and again == first
    local.write_text(_pairs(10).replace("premise", "Premise"))  # same size, other content
    s3.upload(local, "cached/pairs.jsonl")
    changed, report = _rows("pairs", uri, cache_dir=cache)
    assert report.cache == "written" and changed != first and len(changed) == len(first)
    assert len({e.name for e in storage_path(cache).iterdir()} - {"corpus_cache"}) == 2  # an entry per content
    local.write_text(_pairs(10).replace("premise", "PREMISE"))
    s3.upload(local, "cached/pairs.jsonl")
    _, report = _rows("pairs", uri, cache_dir=cache, cache_max_gb=1e-9)  # a byte: the write leaves only its own entry
    assert report.cache == "written"
    again, report = _rows("pairs", uri, cache_dir=cache, cache_max_gb=1e-9)  # a read evicts nothing, lists nothing
    assert report.cache == "read" and again != changed and len(again) == len(first)
    (entry,) = [e for e in storage_path(cache).iterdir() if e.name != "corpus_cache"]  # s3fs lists the prefix too
    killed = entry / "0a" / "rows" / "part.parquet"
    killed.write_bytes(b"half")  # a writer killed before its report
    assert tidy(cache, None) == [] and killed.exists()  # minutes old: perhaps still writing
    assert tidy(cache, None, now=time.time() + 2 * 86400) == [f"{entry.name}/0a (never committed, 48 h old)"]
    assert not killed.exists() and _rows("pairs", uri, cache_dir=cache)[1].cache == "read"


def test_storage_paths_are_local_for_plain_paths_and_file_uris(tmp_path):
    from pathlib import Path

    assert storage_path(f"file://{tmp_path}/a b.jsonl") == tmp_path / "a b.jsonl"
    assert storage_path("~/x") == Path.home() / "x" and type(storage_path("x")) is type(Path("x"))
    assert is_uri("s3://bucket/key") and is_uri("gs://b/k") and not is_uri("file:///tmp/x") and not is_uri("/tmp/x")
    assert str(storage_path("s3://bucket/folder") / "part.jsonl") == "s3://bucket/folder/part.jsonl"


def test_a_model_kept_on_object_storage_is_logged_and_registered_from_there(s3, tmp_path, monkeypatch):
    """A sweep registers its best trial from the trial's output_dir, which may be a URI: the model is copied down,
    logged and registered, and the registered version embeds as the exported folder does."""
    import mlflow
    import numpy as np

    from encoders.backbone import build_encoder, export_encoder, inference_embeddings, load_encoder
    from encoders.model_uris import download_model
    from encoders.sources import resolve_model_source
    from runtime.tracking_store import ensure_experiment
    from storage.paths import local_copy
    from tests.conftest import mlflow_store
    from tracking.model_registry import log_and_register

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    local = export_encoder(build_encoder(resolve_model_source("tiny:bert")), tmp_path / "model")
    uri = s3.upload(local, "sweep/best/model")
    with local_copy(uri) as copied:
        assert sorted(p.relative_to(copied) for p in copied.rglob("*") if p.is_file()) == \
            sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    previous = mlflow.get_tracking_uri()
    try:
        experiment = ensure_experiment("registered-from-s3")
        with mlflow.start_run(experiment_id=experiment) as run:
            registered = log_and_register(uri, run.info.run_id, "raoe-from-s3")
        assert registered["model_uri"] == "models:/raoe-from-s3/1"
        texts = ["a man plays music.", "a dog runs in the park."]
        np.testing.assert_allclose(inference_embeddings(load_encoder(download_model(registered["model_uri"])), texts),
                                   inference_embeddings(load_encoder(str(local)), texts), atol=1e-6)
    finally:
        mlflow.set_tracking_uri(previous)


def test_a_publish_uploads_before_it_removes_and_a_copy_takes_what_its_marker_names(s3, tmp_path, monkeypatch):
    """Publishing once removed the previous export before uploading the new one: a put that failed (a network error,
    a full quota) left neither. Now the files go up first, a commit marker names the new export, and only then are
    the old export's other files removed; a copy of a folder whose files are not what its marker names is refused."""
    import s3fs

    from storage.paths import PUBLISHED, files_under, local_copy, staged_folder

    def export(files: dict[str, str]):
        with staged_folder(s3.uri("runs/r1")) as staged:
            for name, text in files.items():
                (staged.local / "model" / name).parent.mkdir(parents=True, exist_ok=True)
                (staged.local / "model" / name).write_text(text)
            staged.publish()

    def copied() -> dict[str, str]:
        with local_copy(s3.uri("runs/r1/model")) as folder:
            return {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()}

    export({"config.json": "v1", "weights.bin": "one", "old/tokenizer.json": "t"})
    assert copied() == {"config.json": "v1", "weights.bin": "one", "old/tokenizer.json": "t"}

    async def failing_put(self, *args, **kwargs):
        raise OSError("the network went away")

    with monkeypatch.context() as patch:
        patch.setattr(s3fs.S3FileSystem, "_put_file", failing_put)
        with pytest.raises(OSError, match="network went away"):
            export({"config.json": "v2", "weights.bin": "two"})
    assert copied() == {"config.json": "v1", "weights.bin": "one", "old/tokenizer.json": "t"}  # still whole

    export({"config.json": "v2", "weights.bin": "two!"})
    assert copied() == {"config.json": "v2", "weights.bin": "two!"}  # replaced whole: no file of the first export
    assert sorted(name for name, _, _ in files_under(storage_path(s3.uri("runs/r1/model")))) == \
        [PUBLISHED, "config.json", "weights.bin"]
    storage_path(s3.uri("runs/r1/model/weights.bin")).write_bytes(b"half of it")  # a publish that died midway over it
    with pytest.raises(OSError, match=r"not the export its marker .* weights\.bin"):
        copied()


class _Requests:
    """Every request the suite's S3 endpoint answers (werkzeug's log line for each, from any process: the driver's
    and the Ray tasks'), as (method, path)."""

    def __init__(self):
        import logging

        self.seen: list[tuple[str, str]] = []
        handler = logging.Handler()
        handler.emit = self._record
        self.handler, self.logger = handler, logging.getLogger("werkzeug")

    def _record(self, record):
        words = str(record.getMessage()).split('"')
        if len(words) > 1 and len(words[1].split()) >= 2:
            method, path = words[1].split()[:2]
            self.seen.append((re.sub(r"\x1b\[[0-9;]*m", "", method), path.split("?")[0]))

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def test_a_warm_start_over_many_shards_lists_them_and_sends_no_request_per_shard(ray_local, s3, tmp_path):
    """Object storage at scale (issue 71): a corpus of 200 shards, validated once into the cache; the run after
    (a cache hit) lists the shards and the cache entry, and asks nothing of any shard but the first line of the
    first (a HEAD each, for the key, once), nor of the cached Parquet files beyond Ray's own read of them (their
    footers were read one by one on the driver to check the entry, and there was a file per block)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for shard in range(200):
        (folder / f"part-{shard:05d}.jsonl").write_text(_pairs(3))
    uri, cache = s3.upload(folder, "corpus"), s3.uri("runs/corpus_cache")
    first, written = _rows("pairs", uri, cache_dir=cache)
    assert written.cache == "written" and len(first) == 600
    with _Requests() as requests:
        again, read = _rows("pairs", uri, cache_dir=cache)
    assert read.cache == "read" and again == first
    shard_requests = [r for r in requests.seen if "/corpus/part-" in r[1]]
    assert {path.rsplit("/", 1)[-1] for _, path in shard_requests} <= {"part-00000.jsonl"}, shard_requests[:5]
    assert len(shard_requests) <= 2  # the first shard's first line, which tells SNLI rows from plain pairs
    listings = [r for r in requests.seen if r[0] == "GET" and r[1].rstrip("/").endswith(s3.name)]
    # a few listings whatever the shard count (10 here: the corpus's existence, kind and files, the cache entry and
    # its rows, Ray's own read), never one per shard
    assert 1 <= len(listings) <= 12, listings
    cached = {path for method, path in requests.seen if path.endswith(".parquet")}
    gets = [r for r in requests.seen if r[1] in cached]
    # the cache joins blocks into files of 64 MiB (200 blocks were 200 files, and 810 requests of Ray's reader)
    assert len(cached) == 1 and len(gets) <= 20, (len(gets), len(cached))
