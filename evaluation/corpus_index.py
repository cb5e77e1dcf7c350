"""A corpus encoded once per model and corpus: unit-length embeddings in shard files, written by a Ray Data actor
pool (on GPUs where the pool asks for them), searched shard by shard.

The index of a corpus is a folder under ``RAOE_CACHE/corpus-embeddings/<key>``, the key naming the model (its
files' sizes and times, so a retrained folder is a new model; a registry version's download folder is fixed) and
the corpus (the caller's fingerprint of it). Each shard is ``<n>.npy`` (float32 rows) and ``<n>.arrow`` (an
uncompressed Arrow IPC file of ``id``, and ``text`` when kept), both memory-mapped when read: a reader looks up the
ids or texts of the rows it found (``take``) without holding the corpus's columns, and the actors of one node
share the pages. A second evaluation or a promotion of the same model on the same corpus reads the shards instead of
encoding again.

Reading to writing runs in Ray Data: the actors encode and write the shards; the driver only sees shard names.
On a cluster of several nodes put ``RAOE_CACHE`` on storage every node sees (the writers run anywhere)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

import numpy as np

from encoders.cache import building, cache_root
from encoders.devices import EncoderPool, pool_resources
from storage.paths import ABANDONED_AFTER_S, storage_path

SHARD_ROWS = 16384  # rows per shard file: the chunk of one search step
INDEX_FORMAT = 2  # in the cache key: 1 kept ids and texts in parquet, read whole
LAST_USED = "last_used"  # touched in an index's folder each time a job builds or reads it: least recently used goes first
MAX_GB_ENV = "RAOE_INDEX_CACHE_MAX_GB"  # the corpus-index cache's size limit (unset: none), as data.cache_max_gb
IN_USE_S = 3600  # an index used this recently may still be searched by another job: never evicted


@dataclass(frozen=True)
class CorpusIndex:
    path: Path

    @cached_property
    def meta(self) -> dict:  # read once: every shard pass and row count consults it
        return json.loads((self.path / "meta.json").read_text())

    @property
    def rows(self) -> int:
        return int(self.meta["rows"])

    def shards(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first row number, embeddings) of each shard, memory-mapped."""
        for shard, offset in zip(self.meta["shards"], self._offsets):
            yield int(offset), np.load(self.path / f"{shard}.npy", mmap_mode="r")

    def take(self, name: str, rows) -> list[str]:
        """``id`` (or ``text``, when kept) of the given row numbers, in their order: each shard's column is read
        through its memory map, so only the pages of those rows are touched."""
        import pyarrow as pa

        rows = np.asarray(rows, dtype=np.int64).ravel()
        if len(rows) and (rows.min() < 0 or rows.max() >= self.rows):
            raise IndexError(f"row numbers must lie in [0, {self.rows}) of {self.path}")
        out = np.empty(len(rows), dtype=object)
        shard_of = np.searchsorted(self._offsets, rows, side="right") - 1
        for shard in np.unique(shard_of):
            here = shard_of == shard
            column = self._table(int(shard)).column(name)
            out[here] = column.take(pa.array(rows[here] - self._offsets[shard])).to_pylist()
        return out.tolist()

    @cached_property
    def _offsets(self) -> np.ndarray:
        """The first row number of each shard (from the .npy headers), then the total."""
        sizes = [len(np.load(self.path / f"{s}.npy", mmap_mode="r")) for s in self.meta["shards"]]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    @cached_property
    def _tables(self) -> dict:  # shard number -> its memory-mapped table, opened on first use
        return {}

    def _table(self, shard: int):
        import pyarrow as pa

        if shard not in self._tables:
            source = pa.memory_map(str(self.path / f"{self.meta['shards'][shard]}.arrow"), "r")
            self._tables[shard] = pa.ipc.open_file(source).read_all()  # zero-copy: pages stay in the file cache
        return self._tables[shard]


def index_outputs() -> dict[str, str]:
    """Where the encoder actors write corpus indexes, for a job's check that every node reaches it
    (runtime.local_ray.refuse_node_local_outputs)."""
    return {"RAOE_CACHE (corpus indexes)": str(cache_root())}


def model_fingerprint(model_path: str) -> str:
    """A model folder's identity: its files' relative paths, sizes and modification times (an HF id: itself)."""
    root = Path(model_path)
    if not root.is_dir():
        return model_path
    entries = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                     for p in root.rglob("*") if p.is_file())
    return hashlib.sha1(json.dumps([str(root.resolve()), entries]).encode()).hexdigest()


def file_fingerprint(*paths: str | Path) -> str:
    """The content of corpus files (sha1 of their bytes, streamed)."""
    digest = hashlib.sha1()
    for path in paths:
        with storage_path(path).open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def index_key(model_path: str, corpus_key: str, keep_text: bool) -> str:
    spec = {"model": model_fingerprint(model_path), "corpus": corpus_key, "text": keep_text, "format": INDEX_FORMAT}
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def corpus_index(corpus, model_path: str, corpus_key: str, *, pool: EncoderPool, batch_size: int = 64,
                 keep_text: bool = False, root: str | Path | None = None) -> CorpusIndex:
    """The index of ``corpus`` (a Ray Dataset of ``id``, ``text``) under ``model_path``: read from the cache, or
    built by the actor pool and cached."""
    target = Path(root or cache_root() / "corpus-embeddings") / index_key(model_path, corpus_key, keep_text)
    if target.exists():
        problem = index_problem(target)
        if problem is None:
            print(f"corpus embeddings from the cache: {target}", flush=True)
            (target / LAST_USED).touch()
            return CorpusIndex(target)
        print(f"[raoe] cached corpus embeddings {target} ignored and built again: {problem}", flush=True)
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(target.parent)
    with building(target) as staging:
        shards = _encode_into(corpus, model_path, staging, pool=pool, batch_size=batch_size, keep_text=keep_text)
        dims = {int(s["dim"]) for s in shards}
        (staging / "meta.json").write_text(json.dumps({
            "model_path": model_path, "corpus": corpus_key, "rows": int(sum(s["rows"] for s in shards)),
            "dim": dims.pop() if dims else 0, "shards": [s["shard"] for s in shards], "text": keep_text}))
        (staging / LAST_USED).touch()
    limit = os.environ.get(MAX_GB_ENV)
    if limit:
        removed = evict_least_recent(target.parent, float(limit), keep=target.name)
        if removed:
            print(f"[raoe] corpus-index cache {target.parent}: removed {', '.join(removed)}", flush=True)
    return CorpusIndex(target)


def evict_least_recent(root: Path, max_gb: float, keep: str, now: float | None = None) -> list[str]:
    """Whole indexes, least recently used first, until the cache fits under ``max_gb`` (after a build: the only time
    it grows); never ``keep`` (the one just built), a build in progress, or an index used within IN_USE_S (another
    job may be searching it). Returns what was removed."""
    import time

    now, sizes, used = time.time() if now is None else now, {}, {}
    for folder in root.iterdir():
        if not folder.is_dir() or folder.name.startswith("."):  # staging folders of builds in progress
            continue
        files = [p for p in folder.rglob("*") if p.is_file()]
        sizes[folder.name] = sum(p.stat().st_size for p in files)
        marker = folder / LAST_USED
        used[folder.name] = marker.stat().st_mtime if marker.exists() else max(
            [p.stat().st_mtime for p in files] + [folder.stat().st_mtime])
    total, removed = sum(sizes.values()), []
    for name in sorted(sizes, key=used.get):
        if total <= max_gb * 1e9:
            break
        if name == keep or now - used[name] < IN_USE_S:
            continue
        shutil.rmtree(root / name, ignore_errors=True)
        total -= sizes[name]
        removed.append(f"{name} ({sizes[name] / 1e9:.3f} GB, least recently used; {MAX_GB_ENV}={max_gb:g})")
    return removed


def index_problem(folder: Path) -> str | None:
    """What is wrong with a cached index (its meta.json, or shards missing or of other row counts than it says), or
    None when it is whole: a folder that lost a file is built again, never searched with rows missing."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        rows = 0
        for shard in meta["shards"]:
            if not (folder / f"{shard}.arrow").is_file():
                return f"shard {shard}.arrow is missing"
            rows += np.load(folder / f"{shard}.npy", mmap_mode="r").shape[0]
    except (OSError, ValueError, KeyError) as exc:
        return f"it cannot be read ({type(exc).__name__}: {exc})"
    if rows != int(meta["rows"]):
        return f"its shards hold {rows} rows where meta.json counts {meta['rows']}"
    return None


def remove_stale_builds(root: Path, now: float | None = None) -> list[str]:
    """Remove the staging folders (``.<key>.<builder>.tmp``) of builds killed more than ABANDONED_AFTER_S ago."""
    import time

    now, removed = time.time() if now is None else now, []
    for staging in root.glob(".*.tmp"):
        try:
            newest = max([p.stat().st_mtime for p in staging.rglob("*")] + [staging.stat().st_mtime])
        except OSError:  # renamed into place or removed by its builder meanwhile
            continue
        if staging.is_dir() and now - newest > ABANDONED_AFTER_S:
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging.name)
    return removed


def _encode_into(corpus, model_path: str, folder: Path, *, pool: EncoderPool, batch_size: int,
                 keep_text: bool) -> list[dict]:
    """The corpus materialised first, then straight into the actor pool, each actor writing the shards it encodes:
    no task after the actors that would need a CPU they hold (Ray Data would wait forever on a full node)."""
    import ray

    written = corpus.materialize().map_batches(
        ShardWriter, batch_size=SHARD_ROWS, compute=ray.data.ActorPoolStrategy(size=pool.actors),
        fn_constructor_kwargs={"model_path": model_path, "batch_size": batch_size, "gpus": pool.gpus_per_actor,
                               "keep_text": keep_text, "folder": str(folder)},
        **pool_resources(pool.cpus_per_actor, pool.gpus_per_actor))
    return sorted(written.take_all(), key=lambda s: s["shard"])


class ShardWriter:
    """A Ray Data actor: encodes a shard's rows (unit length) and writes its files; returns its name and size."""

    def __init__(self, model_path: str, batch_size: int, gpus: float, keep_text: bool, folder: str):
        from evaluation.encode import SentenceEncoderActor

        self.encoder = SentenceEncoderActor(model_path, batch_size, gpus, keep_text=keep_text, normalise=True)
        self.folder = folder

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        return write_shard(self.encoder(batch), self.folder)


def write_shard(batch: dict[str, np.ndarray], folder: str) -> dict[str, list]:
    """One shard's files from a batch of encoded rows (``id``, ``embedding``, ``text`` when kept)."""
    import pyarrow as pa

    name = uuid.uuid4().hex
    emb = np.ascontiguousarray(batch["embedding"], dtype=np.float32)
    np.save(os.path.join(folder, f"{name}.npy"), emb)
    columns = {"id": pa.array([str(i) for i in batch["id"]], pa.large_string())}
    if "text" in batch:
        columns["text"] = pa.array([str(t) for t in batch["text"]], pa.large_string())
    table = pa.table(columns)
    with pa.OSFile(os.path.join(folder, f"{name}.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)
    return {"shard": [name], "rows": [len(emb)], "dim": [emb.shape[1] if emb.ndim == 2 else 0]}
