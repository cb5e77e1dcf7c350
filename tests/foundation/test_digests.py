"""Content digests for cache keys: the same bytes anywhere are the same key, changed bytes a new one (also where
size and modification time stay), and a warm check hashes nothing."""

import os
import shutil

import pytest

from storage import digests


def _model(folder, weights: bytes):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_a_folder_is_keyed_by_its_files_content_not_where_or_when(tmp_path, monkeypatch):
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    model = _model(tmp_path / "a", b"\x00" * 4096)
    copy = tmp_path / "elsewhere" / "a"
    shutil.copytree(model, copy)  # another folder: the same model (a registry version downloaded again)
    assert digests.tree_digest(model) == digests.tree_digest(copy)

    before = digests.tree_digest(model)
    weights = model / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"\x01" + b"\x00" * 4095)  # retrained: same size, and its time put back
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert digests.tree_digest(model) != before
    (model / "extra.txt").write_text("a file added")
    assert digests.tree_digest(model) != digests.tree_digest(copy)


def test_a_warm_check_hashes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    model = _model(tmp_path / "m", os.urandom(3 << 20))
    hashed = []
    real = digests._sha1
    monkeypatch.setattr(digests, "_sha1", lambda path: hashed.append(path) or real(path))
    first = digests.tree_digest(model)
    assert len(hashed) == 2
    assert digests.tree_digest(model) == first and len(hashed) == 2  # from the table
    (tmp_path / "cache" / digests.TABLE).write_text("{torn")  # a table torn by a racing writer: recomputed
    assert digests.tree_digest(model) == first and len(hashed) == 4


def test_an_object_is_keyed_by_its_content_on_object_storage(s3, tmp_path, monkeypatch):
    from storage.paths import storage_path

    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    uri = s3.uri("qrels/test.tsv")
    storage_path(uri).write_bytes(b"q1\td1\t1\n")
    first = digests.content_digest(uri)
    (tmp_path / "test.tsv").write_bytes(b"q1\td1\t1\n")
    assert digests.content_digest(uri) == first == digests.content_digest(tmp_path / "test.tsv")  # same bytes
    storage_path(uri).write_bytes(b"q1\td2\t1\n")  # regenerated under the same name and size
    assert digests.content_digest(uri) != first


def test_a_hub_name_without_a_cached_snapshot_has_no_revision():
    assert digests.hub_revision("nobody/no-such-model-raoe-test") is None
    with pytest.raises(FileNotFoundError):
        digests.content_digest("/no/such/file")


def test_many_files_are_hashed_at_once_in_order_and_said_before(s3, tmp_path, monkeypatch, capsys):
    """The first check of a corpus of many shards on object storage overlaps its reads (one object after another is
    a round trip and a stream each), returns the digests in the order asked, says what it hashes once it is large,
    and a warm check hashes nothing."""
    import hashlib
    import threading
    import time

    from storage.paths import storage_path

    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "ANNOUNCE_BYTES", 1000)
    blobs = [os.urandom(300 + i) for i in range(8)]
    paths = []
    for i, blob in enumerate(blobs):
        if i % 2:
            storage_path(s3.uri(f"corpus/part-{i}.jsonl")).write_bytes(blob)
            paths.append(s3.uri(f"corpus/part-{i}.jsonl"))
        else:
            (tmp_path / f"part-{i}.jsonl").write_bytes(blob)
            paths.append(tmp_path / f"part-{i}.jsonl")
    real, lock, state = digests._sha1, threading.Lock(), {"now": 0, "most": 0, "calls": 0}

    def watched(path):
        with lock:
            state["now"] += 1
            state["calls"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.2)  # a slow stream: the others start meanwhile
        try:
            return real(path)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(digests, "_sha1", watched)
    named_twice = paths + paths[:2]  # a file named twice is read once
    assert digests.content_digests(named_twice) == [hashlib.sha1(b).hexdigest() for b in blobs + blobs[:2]]
    assert state["calls"] == 8 and state["most"] >= 4
    assert "[raoe] hashing 8 file(s)" in capsys.readouterr().out
    assert digests.content_digests(paths[::-1]) == [hashlib.sha1(b).hexdigest() for b in blobs[::-1]]
    assert state["calls"] == 8 and "hashing" not in capsys.readouterr().out  # warm: from the table
