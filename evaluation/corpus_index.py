"""A corpus encoded once per model and corpus: unit-length embeddings in shard files, written by a Ray Data actor
pool (on GPUs where the pool asks for them), searched shard by shard.

The index of a corpus is a folder under ``RAOE_CACHE/corpus-embeddings/<key>``, the key naming the model (its files'
content: a retrained folder is a new model, the same version downloaded into another folder the same one) and the
corpus (the caller's fingerprint of its content). Each shard is ``<n>.npy`` (float32 rows) and ``<n>.arrow`` (an
uncompressed Arrow IPC file of ``id``, and ``text`` when kept), both memory-mapped when read: a reader looks up the
ids or texts of the rows it found (``take``) without holding the corpus's columns, and the actors of one node
share the pages. A second evaluation or a promotion of the same model on the same corpus reads the shards instead of
encoding again.

Reading to writing runs in Ray Data: the actors encode and write the shards; the driver only sees shard names.
The cache is ``RAOE_INDEX_CACHE`` when set (a shared folder, or an object-store URI such as ``s3://bucket/indexes``),
else ``RAOE_CACHE/corpus-embeddings``. On object storage the actors write the shards straight into the index's folder
and ``meta.json``, written last, commits it; a node copies to its own disk (storage.node_cache), once, only the parts
it reads, and maps them: the id and text columns (a join by id, the texts of rows found), a search actor's own
shards' embeddings, every shard's embeddings only where rows anywhere are read (the stored embeddings of a mining
job's known positives). 8 nodes searching a 100M-row index each copy the eighth they search. On a cluster of
several nodes give it a URI or a shared folder (the writers run anywhere)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator

import numpy as np

from encoders.cache import building, cache_root
from encoders.devices import EncoderPool, pool_resources, shard_pool
from storage import in_use
from storage.digests import content_digests, hub_revision, tree_digest
from storage.node_cache import COMPLETE, node_cache_root, node_copy
from storage.paths import ABANDONED_AFTER_S, files_under, is_uri, join, remove_tree, storage_path, writable_path

SHARD_ROWS = 16384  # rows per shard file at most: the chunk of one search step and of one encoder call
INDEX_FORMAT = 4  # in the cache key: 1 kept ids and texts in parquet, read whole; 2 encoded with no side; 3 no
# per-shard row counts in meta.json
LAST_USED = "last_used"  # touched in an index's folder each time a job builds or reads it: least recently used goes first
MAX_GB_ENV = "RAOE_INDEX_CACHE_MAX_GB"  # the corpus-index cache's size limit (unset: none), as data.cache_max_gb
IN_USE_S = in_use.GRACE_S  # an index used this recently may still be searched by another job: never evicted
INDEX_CACHE_ENV = "RAOE_INDEX_CACHE"  # the corpus-index cache: a path or an object-store URI


def index_root() -> str:
    """Where corpus indexes are kept: RAOE_INDEX_CACHE, else RAOE_CACHE/corpus-embeddings."""
    return os.environ.get(INDEX_CACHE_ENV) or str(cache_root() / "corpus-embeddings")


@dataclass(frozen=True)
class CorpusIndex:
    path: Path  # the index's folder; on object storage, the name this node gives its copies (one per part read)
    location: str = ""  # where the index is kept (a URI for one on object storage): what other nodes open
    remote_meta: str = field(default="", repr=False, compare=False)  # meta.json as read from object storage

    def __reduce__(self):  # sent to another process: it reads through its own node's copies, none of this one's
        return _reopened, (str(self.path), self.location, self.remote_meta)

    @classmethod
    def at(cls, location: str) -> "CorpusIndex":
        """The index kept at ``location``: the folder itself, or (on object storage) the index read through this
        node's copies of the parts that are read: the id and text columns, or the embeddings (a search actor's own
        shards' alone, see ``hold``); each made once per node and named by the index's meta.json (a rebuilt index
        is copied again)."""
        if not is_uri(location):
            return cls(Path(location), location)
        meta = storage_path(join(location, "meta.json")).read_text()
        name = f"index-{location.rstrip('/').rsplit('/', 1)[-1]}-{hashlib.sha1(meta.encode()).hexdigest()[:10]}"
        return cls(node_cache_root() / name, location, meta)

    @cached_property
    def meta(self) -> dict:  # read once: every shard pass and row count consults it
        return json.loads(self.remote_meta or (self.path / "meta.json").read_text())

    @property
    def rows(self) -> int:
        return int(self.meta["rows"])

    def shard_rows(self) -> list[int]:
        """Each shard's row count."""
        return np.diff(self._offsets).tolist()

    def shards(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first row number, embeddings) of each shard, memory-mapped."""
        for number in range(len(self.meta["shards"])):
            yield self.shard(number)

    def shard(self, number: int) -> tuple[int, np.ndarray]:
        """(first row number, embeddings) of shard ``number``, memory-mapped."""
        return int(self._offsets[number]), np.load(self._file(number, "npy"), mmap_mode="r")

    def hold(self, shards: list[int]) -> None:
        """On object storage, copy to this node the embeddings of these shards alone (a search actor's share), unless
        the node holds the whole index's already: 8 nodes searching 100M rows each copy an eighth, not all of it."""
        if not is_uri(self.location) or not shards or self._whole_on_node("embeddings"):
            return
        part = f"embeddings-{min(shards)}-{max(shards)}-{len(shards)}"
        folder = self._node_part(part, shards, "npy")
        self._held.update({s: folder for s in shards})

    def take(self, name: str, rows) -> list[str]:
        """``id`` (or ``text``, when kept) of the given row numbers, in their order: each shard's column is read
        through its memory map, so only the pages of those rows are touched."""
        import pyarrow as pa

        rows = self._checked(rows)
        out = np.empty(len(rows), dtype=object)
        for shard, here, local in self._by_shard(rows):
            out[here] = self._table(shard).column(name).take(pa.array(local)).to_pylist()
        return out.tolist()

    def embeddings(self, rows) -> np.ndarray:
        """The stored unit embeddings of the given row numbers, in their order (float32), read through the shards'
        memory maps: a text the index holds is never encoded again (mining scores a query's known positives so). On
        object storage, unless this node holds every shard's embeddings already, only those rows are read (ranged
        reads of the .npy files): a batch's positives lie anywhere in the index, and copying all of it to every
        node that encodes queries is 300 GB at 100M rows x 768."""
        rows = self._checked(rows)
        dim = int(self.meta["dim"])
        out = np.empty((len(rows), dim), dtype=np.float32)
        remote = is_uri(self.location) and not self._whole_on_node("embeddings")
        for shard, here, local in self._by_shard(rows):
            if remote and shard not in self._held:
                out[here] = self._remote_rows(shard, local, dim)
            else:
                out[here] = np.load(self._file(shard, "npy"), mmap_mode="r")[local]
        return out

    def _remote_rows(self, shard: int, local: np.ndarray, dim: int) -> np.ndarray:
        """Rows ``local`` of a shard's .npy on object storage, one ranged read each (concurrent), after its header
        (the size np.save writes for its shape: index_problem checked each file's size against it)."""
        rows, row_bytes = int(self._offsets[shard + 1] - self._offsets[shard]), dim * 4
        header = npy_bytes(rows, dim) - rows * row_bytes
        place = storage_path(join(self.location, f"{self.meta['shards'][shard]}.npy"))
        starts = [header + int(r) * row_bytes for r in local]
        chunks = place.fs.cat_ranges([place.path] * len(starts), starts, [s + row_bytes for s in starts])
        return np.frombuffer(b"".join(chunks), dtype="<f4").reshape(len(local), dim)


    def _checked(self, rows) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64).ravel()
        if len(rows) and (rows.min() < 0 or rows.max() >= self.rows):
            raise IndexError(f"row numbers must lie in [0, {self.rows}) of {self.path}")
        return rows

    def _by_shard(self, rows: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(shard number, which of ``rows`` it holds, their row numbers within it) for each shard ``rows`` touch."""
        shard_of = np.searchsorted(self._offsets, rows, side="right") - 1
        for shard in np.unique(shard_of):
            here = shard_of == shard
            yield int(shard), here, rows[here] - self._offsets[shard]

    def ids_and_rows(self, first_shard: int, shards: int):
        """(id, row number) of every row of ``shards`` shards from ``first_shard``, as an Arrow table: what a join
        by id with the index needs (row_ids)."""
        import pyarrow as pa

        parts = [pa.table({"id": self._table(s).column("id").cast(pa.string()),
                           "row": pa.array(np.arange(self._offsets[s], self._offsets[s + 1], dtype=np.int64))})
                 for s in range(first_shard, min(first_shard + shards, len(self.meta["shards"])))]
        return pa.concat_tables(parts) if parts else pa.table({"id": pa.array([], pa.string()),
                                                               "row": pa.array([], pa.int64())})

    @cached_property
    def _offsets(self) -> np.ndarray:
        """The first row number of each shard (meta.json's counts; an index written before them: the .npy
        headers), then the total."""
        sizes = self.meta.get("shard_rows") or [len(np.load(self._file(s, "npy"), mmap_mode="r"))
                                                for s in range(len(self.meta["shards"]))]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    @cached_property
    def _tables(self) -> dict:  # shard number -> its memory-mapped table, opened on first use
        return {}

    @cached_property
    def _held(self) -> dict:  # shard number -> this node's copy holding its embeddings (``hold``)
        return {}

    @cached_property
    def _parts(self) -> dict:  # part name -> this node's copy of it
        return {}

    def _table(self, shard: int):
        import pyarrow as pa

        if shard not in self._tables:
            source = pa.memory_map(str(self._file(shard, "arrow")), "r")
            self._tables[shard] = pa.ipc.open_file(source).read_all()  # zero-copy: pages stay in the file cache
        return self._tables[shard]

    def _file(self, shard: int, ext: str) -> Path:
        """Where this process reads shard ``shard``'s ``ext`` file (npy: embeddings, arrow: ids and texts): in the
        index's folder, or on object storage in this node's copy of the part holding it (the shards ``hold`` took,
        else all the index's files of that kind)."""
        name = f"{self.meta['shards'][shard]}.{ext}"
        if not is_uri(self.location):
            return self.path / name
        if ext == "npy" and shard in self._held:
            return self._held[shard] / name
        return self._node_part("embeddings" if ext == "npy" else "columns", range(len(self.meta["shards"])), ext) / name

    def _node_part(self, part: str, shards, ext: str) -> Path:
        """This node's copy of ``part``: the ``ext`` files of ``shards`` (listed only when it is first copied)."""
        if part not in self._parts:
            files = [f"{self.meta['shards'][s]}.{ext}" for s in shards]
            self._parts[part] = node_copy(self.location, f"{self.path.name}-{part}", files=files,
                                          contents={"meta.json": self.remote_meta})
        return self._parts[part]

    def _whole_on_node(self, part: str) -> bool:
        return part in self._parts or (self.path.with_name(f"{self.path.name}-{part}") / COMPLETE).exists()


def _reopened(path: str, location: str, remote_meta: str) -> CorpusIndex:
    if not remote_meta:
        return CorpusIndex(Path(path), location)
    return CorpusIndex(node_cache_root() / Path(path).name, location, remote_meta)


def row_ids(index: CorpusIndex, shards_per_task: int = 8):
    """A Ray Dataset of (``id``, ``row``) for every row of ``index``, read from its shards' id columns by tasks (on
    object storage from each node's copy): joined with other rows by id, it tells where the index holds a text
    without any id or row reaching the driver."""
    import ray

    starts = [{"first_shard": s} for s in range(0, len(index.meta["shards"]), shards_per_task)]
    return ray.data.from_items(starts or [{"first_shard": 0}]).map_batches(
        _ids_and_rows, fn_kwargs={"location": index.location, "shards": shards_per_task}, batch_size=1,
        batch_format="pyarrow")


def _ids_and_rows(batch, location: str, shards: int):
    import pyarrow as pa

    index = CorpusIndex.at(location)
    return pa.concat_tables([index.ids_and_rows(int(first), shards)
                             for first in batch["first_shard"].to_pylist()])


def index_outputs() -> dict[str, str]:
    """Where the encoder actors write corpus indexes, for a job's check that every node reaches it
    (runtime.local_ray.refuse_node_local_paths)."""
    return {f"{INDEX_CACHE_ENV} (corpus indexes)": index_root()}


def model_fingerprint(model_path: str) -> str:
    """A model's identity: a folder's files by content (their digests are remembered per file, so a warm check
    hashes nothing, and the same files in another folder are the same model); a hub id by the revision of its
    snapshot in the local hub cache (the id alone where none is cached)."""
    if Path(model_path).is_dir():
        return tree_digest(model_path)
    revision = hub_revision(model_path)
    return f"{model_path}@{revision}" if revision else model_path


def file_fingerprint(*paths: str | Path) -> str:
    """The content of corpus files (their digests, remembered per file)."""
    return hashlib.sha1(json.dumps(content_digests(paths)).encode()).hexdigest()


def index_key(model_path: str, corpus_key: str, keep_text: bool) -> str:
    spec = {"model": model_fingerprint(model_path), "corpus": corpus_key, "text": keep_text, "format": INDEX_FORMAT}
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def corpus_index(corpus, model_path: str, corpus_key: str, *, pool: EncoderPool, batch_size: int = 64,
                 keep_text: bool = False, root: str | Path | None = None) -> CorpusIndex:
    """The index of ``corpus`` (a Ray Dataset of ``id``, ``text``) under ``model_path``: read from the cache, or
    built by the actor pool and cached."""
    return _cached(str(root or index_root()), index_key(model_path, corpus_key, keep_text),
                   lambda folder: _write_index(corpus, model_path, corpus_key, folder, pool, batch_size, keep_text))


def aligned_index(index: CorpusIndex, model_path: str, *, pool: EncoderPool, batch_size: int = 64,
                  root: str | Path | None = None) -> CorpusIndex:
    """``index``'s rows encoded by another model (a teacher), shard for shard and in its order: row r of both holds
    the same text, so the other model's score of any row a search of ``index`` found is read by its row number, and
    each corpus text is encoded once by that model however many queries find it. Cached like any index, keyed by
    ``index``'s own key (its model and corpus) and the other model's files; ``index`` must keep its texts."""
    if not index.meta.get("text"):
        raise ValueError(f"{index.location}: an aligned index encodes the texts of an index that keeps them")
    return _cached(str(root or index_root()), aligned_key(index, model_path),
                   lambda folder: _write_aligned(index, model_path, folder, pool, batch_size))


def aligned_key(index: CorpusIndex, model_path: str) -> str:
    """An aligned index's cache key: ``index``'s key and its shards (uniquely named by each build, so a rebuilt
    ``index``, whose rows come in another order, never finds the old aligned one) and the other model's files."""
    spec = {"aligned_with": index.location.rstrip("/").rsplit("/", 1)[-1], "shards": index.meta["shards"],
            "model": model_fingerprint(model_path), "format": INDEX_FORMAT}
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def _cached(root: str, key: str, write) -> CorpusIndex:
    """The index ``key`` under ``root``: read from the cache, or written by ``write(folder)`` and cached; the cache
    then trimmed to its size limit."""
    found = _on_object_storage(write, join(root, key)) if is_uri(root) else _on_file_system(write, Path(root) / key)
    limit = os.environ.get(MAX_GB_ENV)
    if limit and found.built:
        removed = evict_least_recent(root, float(limit), keep=key)
        if removed:
            print(f"[raoe] corpus-index cache {root}: removed {', '.join(removed)}", flush=True)
    return found.index


@dataclass(frozen=True)
class _Found:
    index: CorpusIndex
    built: bool  # by this call (the only time the cache grows)


def _on_file_system(write, target: Path) -> _Found:
    """A local or shared folder: built in a staging folder renamed into place (a finished index wins)."""
    if target.exists():
        problem = index_problem(target)
        if problem is None:
            print(f"corpus embeddings from the cache: {target}", flush=True)
            _record_use(str(target))
            return _Found(CorpusIndex.at(str(target)), built=False)
        print(f"[raoe] cached corpus embeddings {target} ignored and built again: {problem}", flush=True)
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(target.parent)
    with building(target) as staging:
        write(str(staging))
    _record_use(str(target))
    return _Found(CorpusIndex.at(str(target)), built=True)


def _on_object_storage(write, target: str) -> _Found:
    """An object-store prefix (no rename there): the actors write uniquely named shards into it and meta.json,
    written last, commits the index; a build racing another commits its own shards, never a mix. Checked whole from
    one listing (each shard's files there, of the sizes its row count gives); one that lost a file is built again."""
    if storage_path(join(target, "meta.json")).exists():
        _record_use(target)  # first: no job's eviction takes it while a node copies from it
        problem = index_problem(target)
        if problem is None:
            print(f"corpus embeddings from the cache: {target} (each node copies the parts it reads)", flush=True)
            return _Found(CorpusIndex.at(target), built=False)
        print(f"[raoe] cached corpus embeddings {target} ignored and built again: {problem}", flush=True)
        remove_tree(storage_path(target))  # its meta.json names what is not there: no job can search it
    write(target)
    _record_use(target)
    return _Found(CorpusIndex.at(target), built=True)


def _write_index(corpus, model_path: str, corpus_key: str, folder: str, pool: EncoderPool, batch_size: int,
                 keep_text: bool) -> None:
    """The shards (by the actor pool), then meta.json naming them, then the record of its use."""
    shards = _encode_into(corpus, model_path, folder, pool=pool, batch_size=batch_size, keep_text=keep_text)
    dims = {int(s["dim"]) for s in shards}
    writable_path(join(folder, "meta.json")).write_text(json.dumps({
        "model_path": model_path, "corpus": corpus_key, "rows": int(sum(s["rows"] for s in shards)),
        "dim": dims.pop() if dims else 0, "shards": [s["shard"] for s in shards],
        "shard_rows": [int(s["rows"]) for s in shards], "text": keep_text}))
    in_use.mark(join(folder, LAST_USED))  # once: on a file system the folder is a staging one, renamed into place


def _write_aligned(index: CorpusIndex, model_path: str, folder: str, pool: EncoderPool, batch_size: int) -> None:
    """Each shard of ``index`` encoded by the actor pool into a shard of the same name and rows, then meta.json (the
    same shard list, so the same row numbers)."""
    import ray

    names = list(index.meta["shards"])
    written = ray.data.from_items([{"shard": i} for i in range(len(names))], override_num_blocks=len(names)
                                  ).map_batches(
        AlignedShardWriter, batch_size=1, compute=shard_pool(min(pool.actors, len(names))),  # an actor a shard at most
        fn_constructor_kwargs={"location": index.location, "model_path": model_path, "batch_size": batch_size,
                               "gpus": pool.gpus_per_actor, "folder": folder},
        **pool_resources(pool.cpus_per_actor, pool.gpus_per_actor)).take_all() if names else []
    dims = {int(s["dim"]) for s in written}
    writable_path(join(folder, "meta.json")).write_text(json.dumps({
        "model_path": model_path, "corpus": index.meta["corpus"], "rows": index.rows,
        "dim": dims.pop() if dims else 0, "shards": names, "shard_rows": index.shard_rows(), "text": False,
        "aligned_with": index.location}))
    in_use.mark(join(folder, LAST_USED))  # once: on a file system the folder is a staging one, renamed into place


class AlignedShardWriter:
    """A Ray Data actor: a shard of another index, its texts encoded by this model (unit length) into a shard of
    the same name and row order."""

    def __init__(self, location: str, model_path: str, batch_size: int, gpus: float, folder: str):
        from evaluation.encode import SentenceEncoderActor

        self.index = CorpusIndex.at(location)
        self.encoder = SentenceEncoderActor(model_path, batch_size, gpus, normalise=True, side="document")
        self.folder = folder

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        out = {"shard": [], "rows": [], "dim": []}
        for shard in batch["shard"]:
            table = self.index._table(int(shard))
            rows = {name: np.array(table.column(name).to_pylist(), dtype=object) for name in ("id", "text")}
            written = write_shard(self.encoder(rows), self.folder, name=self.index.meta["shards"][int(shard)])
            for key in out:
                out[key] += written[key]
        return out


def _record_use(folder: str) -> None:
    """The index's last use, as the modification time of its LAST_USED file (an object's on object storage): marked
    now and every few minutes while this process lives (storage.in_use), so a search longer than the grace period
    is never evicted from under it."""
    in_use.hold(join(folder, LAST_USED))


def evict_least_recent(root: str | Path, max_gb: float, keep: str, now: float | None = None) -> list[str]:
    """Whole indexes, least recently used first, until the cache fits under ``max_gb`` (after a build: the only time
    it grows); never ``keep`` (the one just built), a build in progress, or an index used within IN_USE_S (another
    job may be searching it). One listing of the cache (a local folder or an object-store prefix). Returns what was
    removed."""
    import time

    now, sizes, marked, newest, whole = time.time() if now is None else now, {}, {}, {}, set()
    for name, size, mtime in files_under(storage_path(root)):
        index, _, rest = name.partition("/")
        if not rest or index.startswith("."):  # a loose file, or the staging folder of a build in progress
            continue
        sizes[index] = sizes.get(index, 0) + size
        newest[index] = max(newest.get(index, 0.0), mtime)
        if rest == LAST_USED:
            marked[index] = mtime
        elif rest == "meta.json":
            whole.add(index)
    # Only committed indexes: a folder without meta.json is a build in progress (on object storage the shards are
    # written in place) or not an index at all.
    sizes = {index: size for index, size in sizes.items() if index in whole}
    used = {index: marked.get(index, newest[index]) for index in sizes}  # the recorded use, else the files' times
    total, removed = sum(sizes.values()), []
    for name in sorted(sizes, key=used.get):
        if total <= max_gb * 1e9:
            break
        if name == keep or now - used[name] < IN_USE_S:
            continue
        remove_tree(storage_path(join(str(root), name)))
        total -= sizes[name]
        removed.append(f"{name} ({sizes[name] / 1e9:.3f} GB, least recently used; {MAX_GB_ENV}={max_gb:g})")
    return removed


def index_problem(location: str | Path) -> str | None:
    """What is wrong with a cached index, local or on object storage (its meta.json, or shards missing or of other
    row counts than it says), or None when it is whole; an error of the store that is no such evidence (a SlowDown, a
    timeout) is raised, never taken as a broken index to remove: one that lost a file is built again, never searched with
    rows missing. One listing; on object storage a shard's rows are checked by its .npy's size (no download)."""
    place = storage_path(str(location))
    try:
        meta = json.loads(storage_path(join(str(location), "meta.json")).read_text())
        sizes = {name: size for name, size, _ in files_under(place)}
        claimed = meta.get("shard_rows") or [None] * len(meta["shards"])
        rows = 0
        for shard, count in zip(meta["shards"], claimed):
            for ext in ("arrow", "npy"):
                if f"{shard}.{ext}" not in sizes:
                    return f"shard {shard}.{ext} is missing"
            if isinstance(place, Path):
                held = np.load(place / f"{shard}.npy", mmap_mode="r").shape[0]
            elif count is None:
                return "its meta.json predates per-shard row counts"
            else:
                if sizes[f"{shard}.npy"] != npy_bytes(int(count), int(meta["dim"])):
                    return f"shard {shard}.npy holds {sizes[f'{shard}.npy']} bytes, not {count} rows of {meta['dim']}"
                held = int(count)
            if count is not None and held != int(count):
                return f"shard {shard}.npy holds {held} rows where meta.json counts {count}"
            rows += held
    except (FileNotFoundError, ValueError, KeyError) as exc:  # gone, or not what an index writes: definite
        return f"it cannot be read ({type(exc).__name__}: {exc})"
    except OSError as exc:  # the store said no for now (SlowDown, a timeout, a permission): nothing says it is broken
        raise OSError(f"could not check the cached corpus index {location} ({type(exc).__name__}: {exc}); it is left "
                      f"as it is (other jobs may be searching it): run again once the store answers") from exc
    if rows != int(meta["rows"]):
        return f"its shards hold {rows} rows where meta.json counts {meta['rows']}"
    return None


def npy_bytes(rows: int, dim: int) -> int:
    """The size of the .npy file ``np.save`` writes for a float32 matrix of that shape (its header, then the rows)."""
    import io

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
    return header.tell() + rows * dim * 4


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


def shard_pieces(blocks: list[tuple[int, int]], actors: int) -> list[list[tuple[int, int, int]]]:
    """Each shard's ``(block, start, stop)`` pieces, cut from the blocks' rows (``(start, end)`` of each) taken end to
    end: as many shards as whole rounds of the pool's actors need to hold at most SHARD_ROWS rows each (fewer only
    where there are fewer rows than actors), of sizes within one row, whatever the blocks' sizes."""
    actors, total = max(1, actors), sum(end - start for start, end in blocks)
    parts = min(total, actors * math.ceil(total / (SHARD_ROWS * actors)))
    bounds = [round(k * total / parts) for k in range(parts + 1)] if parts else []
    shards, block, block_first = [], 0, 0  # the block holding row ``bounds[k]`` of the whole, and its first row there
    for low, high in zip(bounds, bounds[1:]):
        pieces, row = [], low
        while row < high:
            start, end = blocks[block]
            if row >= block_first + end - start:  # past this block's rows: the next block
                block_first += end - start
                block += 1
                continue
            stop = min(high, block_first + end - start)
            pieces.append((block, start + row - block_first, start + stop - block_first))
            row = stop
        shards.append(pieces)
    return shards


def _encode_into(corpus, model_path: str, folder: str, *, pool: EncoderPool, batch_size: int,
                 keep_text: bool) -> list[dict]:
    """The corpus materialised first, then cut into shards (shard_pieces) that the actor pool takes one at a time,
    each actor writing the shards it encodes: no task after the actors that would need a CPU they hold (Ray Data
    would wait forever on a full node). (Handed whole blocks, two at a time, one actor of two encoded a 29,990-text
    corpus while the other waited.)"""
    import ray

    materialized = corpus.materialize()  # held until the actors are done with its blocks
    spans = _block_spans(materialized)
    shards = shard_pieces([(start, end) for _, start, end in spans], pool.actors)
    if not shards:
        return []
    written = ray.data.from_items([{"pieces": json.dumps(pieces)} for pieces in shards],
                                  override_num_blocks=len(shards)).map_batches(
        PiecesWriter, batch_size=1, compute=shard_pool(min(pool.actors, len(shards))),
        fn_constructor_kwargs={"blocks": [ref for ref, _, _ in spans], "model_path": model_path,
                               "batch_size": batch_size, "gpus": pool.gpus_per_actor, "keep_text": keep_text,
                               "folder": folder},
        **pool_resources(pool.cpus_per_actor, pool.gpus_per_actor))
    return sorted(written.take_all(), key=lambda s: s["shard"])


def _block_spans(materialized) -> list[tuple]:
    """(object reference, first row, end row) of each block of a materialised dataset, as far as the dataset holds it
    (Ray Data's developer API ``iter_internal_ref_bundles``: each entry's ``ref``, the bundle's ``slices``)."""
    spans = []
    for bundle in materialized.iter_internal_ref_bundles():
        for entry, piece in zip(bundle.blocks, bundle.slices):
            rows = entry.metadata.num_rows
            if rows is None:
                raise ValueError("a block of the corpus does not know its row count: it cannot be cut into shards")
            spans.append((entry.ref, *((piece.start_offset, piece.end_offset) if piece else (0, rows))))
    return spans


class ShardWriter:
    """A Ray Data actor: encodes a shard's rows (unit length) and writes its files; returns its name and size."""

    def __init__(self, model_path: str, batch_size: int, gpus: float, keep_text: bool, folder: str):
        from evaluation.encode import SentenceEncoderActor

        self.encoder = SentenceEncoderActor(model_path, batch_size, gpus, keep_text=keep_text, normalise=True,
                                            side="document")
        self.folder = folder

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        return write_shard(self.encoder(batch), self.folder)


class PiecesWriter(ShardWriter):
    """A Ray Data actor: a shard of the rows its pieces name, ``(block, start, stop)`` of the corpus's blocks
    (``blocks``: the driver's object references, each read whole onto the actor's node)."""

    def __init__(self, blocks: list, **writer):
        super().__init__(**writer)
        self.blocks = blocks

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        import ray
        from ray.data.block import BlockAccessor

        parts = [BlockAccessor.for_block(BlockAccessor.for_block(ray.get(self.blocks[block])).slice(start, stop))
                 .to_batch_format("numpy") for block, start, stop in json.loads(str(batch["pieces"][0]))]
        return super().__call__({column: np.concatenate([part[column] for part in parts]) for column in parts[0]})


def write_shard(batch: dict[str, np.ndarray], folder: str, name: str | None = None) -> dict[str, list]:
    """One shard's files from a batch of encoded rows (``id``, ``embedding``, ``text`` when kept), named ``name``
    (an aligned index's: its source shard's) or uniquely."""
    import pyarrow as pa

    name = name or uuid.uuid4().hex
    emb = np.ascontiguousarray(batch["embedding"], dtype=np.float32)
    with writable_path(join(folder, f"{name}.npy")).open("wb") as sink:  # a local folder or an object store
        np.save(sink, emb)
    columns = {"id": pa.array([str(i) for i in batch["id"]], pa.large_string())}
    if "text" in batch:
        columns["text"] = pa.array([str(t) for t in batch["text"]], pa.large_string())
    table = pa.table(columns)
    with writable_path(join(folder, f"{name}.arrow")).open("wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)
    return {"shard": [name], "rows": [len(emb)], "dim": [emb.shape[1] if emb.ndim == 2 else 0]}
