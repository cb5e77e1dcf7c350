"""Content digests of files, for cache keys that change exactly when the bytes change.

A key made of a path, a size and a modification time misses a file rewritten within the clock's resolution or
copied with its time kept, and changes for a copy of the same bytes elsewhere (a registry version downloaded again
into another folder). Hashing a 15 GB checkpoint at every evaluation is too slow, so each local file's sha1 is kept
in a small table under ``RAOE_CACHE`` keyed by (path, size, mtime, a hash of its first and last MB): a warm check
reads the table and 2 MB of each file, and a file rewritten within the clock's resolution is still seen where its
edges changed (a small file, such as qrels, is all edge).
On object storage the table is keyed by the store's ETag (a checksum of the object), so a warm check reads no bytes
there either; the digest itself is the same sha1 as on a file system (the same bytes anywhere, the same key).

    content_digest("/models/a/model.safetensors")     # sha1 hex of the bytes, from the table when unchanged
    tree_digest("/models/a")                          # the folder's files: relative names and their digests
    hub_revision("BAAI/bge-small-en-v1.5")           # the commit of its snapshot in the local hub cache, or None
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from storage.paths import storage_path

TABLE = "file-digests.json"  # under RAOE_CACHE: {"<path>|<size>|<mtime_ns>|<edges>": sha1}
BLOCK = 1 << 24
EDGE_BYTES = 1 << 20
HASH_THREADS = 16  # files checked and hashed at once
ANNOUNCE_BYTES = 1 << 30  # hashing more than this says so first


def _table_path() -> Path:
    return Path(os.environ.get("RAOE_CACHE", Path.home() / ".cache" / "raoe")) / TABLE


def _read_table() -> dict[str, str]:
    try:
        return json.loads(_table_path().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or torn by a writer that lost a race: digests are recomputed, never wrong


def _remember(entries: dict[str, str]) -> None:
    """Add entries to the table (written to a private file, renamed into place: readers never see half of it)."""
    path = _table_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = {**_read_table(), **entries}
        staging = path.with_name(f".{TABLE}.{uuid.uuid4().hex[:8]}")
        staging.write_text(json.dumps(table))
        os.replace(staging, path)
    except OSError:
        pass  # a read-only cache: the digests are right, only not remembered


def _sha1(path) -> str:
    digest = hashlib.sha1()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _edges(path: Path, size: int) -> str:
    digest = hashlib.sha1()
    with path.open("rb") as f:
        digest.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(f.read(EDGE_BYTES))
    return digest.hexdigest()[:16]


def content_digest(path) -> str:
    """The sha1 of the file's bytes, the same for the same bytes on a file system or object storage; remembered by
    what says the file is unchanged (``_table_key``)."""
    return content_digests([path])[0]


def content_digests(paths) -> list[str]:
    """``content_digest`` of each path, in order, the table read and written once. Files are checked and hashed
    ``HASH_THREADS`` at a time: on object storage each is a request and a stream of its own (one at a time, the
    first check of a corpus of thousands of shards is thousands of round trips and one object read after another;
    hashlib leaves the GIL to the other threads while it hashes a block)."""
    paths = [storage_path(p) for p in paths]
    if not paths:
        return []
    table = _read_table()
    with ThreadPoolExecutor(min(HASH_THREADS, len(paths)), thread_name_prefix="raoe-digest") as pool:
        keys, sizes = zip(*pool.map(_table_key, paths))
        # each file not in the table, once however often it is named (an object without an ETag: by its place)
        todo = {key if key is not None else i: i for i, key in enumerate(keys) if key is None or key not in table}
        _announce(len(todo), sum(sizes[i] for i in todo.values()), any(k is None for k in keys))
        hashed = dict(zip(todo, pool.map(_sha1, [paths[i] for i in todo.values()])))
    new = {key: digest for key, digest in hashed.items() if isinstance(key, str)}
    if new:
        _remember(new)
    return [hashed[key] if key in hashed else hashed[i] if key is None else table[key] for i, key in enumerate(keys)]


def _announce(files: int, size: int, untagged: bool) -> None:
    """A line before hashing what will take a while (the first check of a large corpus)."""
    if size >= ANNOUNCE_BYTES:
        kept = ("objects without an ETag are hashed at every check" if untagged else
                f"once, then remembered in {_table_path()}")
        print(f"[raoe] hashing {files} file(s) ({size / 1e9:.1f} GB), {HASH_THREADS} at a time: {kept}", flush=True)


def _table_key(path) -> tuple[str | None, int]:
    """(what says a file still holds the bytes its remembered digest was made of, its size): on a file system its
    path, size, mtime and edges; on object storage its URI, size and the store's ETag (a checksum of the object), or
    None where the store gives none (the bytes are then hashed each time)."""
    if isinstance(path, Path):
        stat = path.stat()
        return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_edges(path, stat.st_size)}", stat.st_size
    info = path.fs.info(path.path)
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    return (f"{path}|{info.get('size')}|{tag}" if tag else None), int(info.get("size") or 0)


def tree_digest(folder) -> str:
    """A folder's content: its files' relative names and digests (where it is kept does not count)."""
    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    names = [p.relative_to(root).as_posix() for p in files]
    return hashlib.sha1(json.dumps(list(zip(names, content_digests(files)))).encode()).hexdigest()


def hub_revision(repo_id: str, repo_type: str = "model") -> str | None:
    """The commit of the hub repository's snapshot in the local hub cache (what a load reads offline), or None
    where there is none: a hub name alone does not say which weights or rows it meant."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)).name
    except Exception:  # not cached, not a repository name, or no hub client: the caller keeps the name
        return None
