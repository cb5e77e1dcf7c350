"""The training corpus as the workers see it: Arrow blocks in Ray's object store, in an order that is a function of
content, addressed by row index.

The validated corpus is ordered once by a hash of each row's content (``content_ordered``: one Ray task per block
hashes it, one more sorts the 8-byte keys; the driver holds only references), so a resubmitted job that reads the
files again (Ray Data may hand out blocks in another order) sees the same rows at every step; the workers get
references to the blocks and to that order. A worker maps them (``CorpusRows``): on its
node the object store holds one copy for all its workers, read without copying, and only the rows of the worker's
own micro-batches become Python objects. So a worker's memory does not grow with the corpus, and nothing is loaded
through a per-worker Ray Data iterator. With data.node_local the same blocks and order are written once as Arrow files
on shared storage (``write_files``) and each node maps its own copy of them (storage.node_cache) instead: for a corpus
larger than a node's object store.

``MicroBatchFeed`` takes the rows of the next micro-batch and tokenises them in a background thread while the current
one trains, and counts the time the loop still waited for them (``data_wait_s``)."""

from __future__ import annotations

import hashlib
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

from training.plan import StepPlan


@dataclass(frozen=True)
class CorpusBlocks:
    """The training corpus in Ray's object store: its Arrow blocks, and the content order of its rows."""

    blocks: tuple[Any, ...]  # ray.ObjectRef[pyarrow.Table], in the order the row positions count them
    order: Any  # ray.ObjectRef[np.ndarray]: row i of the corpus is position order[i] of the blocks
    rows: int
    fingerprint: str = ""  # the rows' content, whatever their order or files (checkpoints record it)
    files: str | None = None  # data.node_local: the same blocks and order as files on shared storage (write_files)


def content_ordered(ds) -> CorpusBlocks:
    """The (validated, materialised) corpus ordered by a content hash, computed on the cluster: one Ray task per
    block hashes its rows where the block is, one more argsorts the keys (8 bytes a row; ties are identical rows)
    and fingerprints them. The driver holds references and two numbers, nothing a row (at 100M rows the order is
    800 MB, held once in the object store of the node that sorted it). The blocks stay in the object store,
    referenced by the result (keep it alive while workers train)."""
    import ray

    blocks = ds.to_arrow_refs()  # zero-copy: a materialised dataset's blocks are Arrow already
    # DEFAULT: not captured by a Tune trial's placement group (its driver bundle holds 0.1 CPU), as Ray Data's own
    # tasks are not
    hashing = ray.remote(num_cpus=1, scheduling_strategy="DEFAULT")(row_keys)
    ordering = ray.remote(num_cpus=1, num_returns=3, scheduling_strategy="DEFAULT")(order_by_keys)
    order, rows, fingerprint = ordering.remote(*[hashing.remote(block) for block in blocks])
    rows, fingerprint = ray.get([rows, fingerprint])
    return CorpusBlocks(blocks=tuple(blocks), order=order, rows=rows, fingerprint=fingerprint)


MANIFEST, ORDER_FILE = "corpus.json", "order.npy"


def write_files(corpus: CorpusBlocks, folder: str) -> CorpusBlocks:
    """The corpus as files under ``folder`` (shared storage: a URI or a mount every node sees), for workers that map
    it from their node's disk instead of the object store (data.node_local). Each write is an attempt folder of its
    own: one uncompressed Arrow IPC file a block, written by a Ray task where the block is, the order as
    ``order.npy`` and the attempt's manifest; then ``<folder>/corpus.json`` names the committed attempt (written last,
    whole: two runs writing the same corpus at once, a sweep's trials, never mix their files). A folder whose
    manifest has this fingerprint already holds these rows (in its own block split and order) and is used as it is.
    The result holds no object references, so the object store can let the blocks go."""
    import json

    import ray

    from storage.paths import join, storage_path, write_whole

    pointer = storage_path(join(folder, MANIFEST))
    if pointer.exists():
        held = json.loads(pointer.read_text())
        done = held.get("attempt")
        if (held.get("fingerprint") == corpus.fingerprint and held.get("rows") == corpus.rows and done
                and storage_path(join(folder, done, MANIFEST)).exists()):  # and not removed by hand since
            return _on_files(corpus, join(folder, done))
    attempt = f"attempt-{uuid.uuid4().hex[:12]}"
    names = [f"block-{i:06d}.arrow" for i in range(len(corpus.blocks))]
    # DEFAULT: not in a Tune trial's placement group
    write_block, write_order = (ray.remote(num_cpus=1, scheduling_strategy="DEFAULT")(f)
                                for f in (_write_block, _write_order))
    written = ray.get([write_block.remote(block, join(folder, attempt, name))
                       for block, name in zip(corpus.blocks, names)]
                      + [write_order.remote(corpus.order, join(folder, attempt, ORDER_FILE))])
    if sum(written[:-1]) != corpus.rows or written[-1] != corpus.rows:
        raise RuntimeError(f"writing the corpus files under {folder} gave {written} rows of {corpus.rows}")
    manifest = {"fingerprint": corpus.fingerprint, "rows": corpus.rows, "blocks": names, "order": ORDER_FILE}
    write_whole(join(folder, attempt, MANIFEST), json.dumps(manifest))
    write_whole(join(folder, MANIFEST), json.dumps({**manifest, "attempt": attempt}))
    return _on_files(corpus, join(folder, attempt))


def _on_files(corpus: CorpusBlocks, attempt: str) -> CorpusBlocks:
    return CorpusBlocks(blocks=(), order=None, rows=corpus.rows, fingerprint=corpus.fingerprint, files=attempt)


def _write_block(table, uri: str) -> int:
    import pyarrow as pa

    from storage.paths import writable_path

    with writable_path(uri).open("wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return table.num_rows


def _write_order(order: np.ndarray, uri: str) -> int:
    from storage.paths import writable_path

    with writable_path(uri).open("wb") as sink:
        np.save(sink, order)
    return len(order)


def order_by_keys(*block_keys: np.ndarray) -> tuple[np.ndarray, int, str]:
    """(the content order of the rows whose keys the blocks hold, in block order; the row count; the fingerprint)."""
    keys = np.concatenate(block_keys) if block_keys else np.zeros(0, np.uint64)
    order = np.argsort(keys, kind="stable")
    return order, len(order), content_fingerprint(keys[order])


def content_fingerprint(sorted_keys: np.ndarray) -> str:
    """What a corpus holds, as a short hash of its rows' sorted content keys: the same rows give the same
    fingerprint from any files, block split or order; one row more, less or changed gives another."""
    return hashlib.sha1(np.ascontiguousarray(sorted_keys, dtype=np.uint64).tobytes()).hexdigest()[:16]


def row_keys(table) -> np.ndarray:
    """A 64-bit hash of each row's content, computed on the pandas view Ray Data gives of the block."""
    from ray.data.block import BlockAccessor

    frame = BlockAccessor.for_block(table).to_pandas()
    return pd.util.hash_pandas_object(frame.apply(_hashable), index=False).to_numpy()


def _hashable(column: pd.Series) -> pd.Series:
    """Numbers and text as they are; any other cell (a ranked list's sentences, a teacher matrix, held as objects or
    as Ray's tensor columns) as one string."""
    api = pd.api.types
    if column.dtype != object and (api.is_numeric_dtype(column) or api.is_string_dtype(column)
                                   or api.is_bool_dtype(column)):
        return column
    # cell by cell: a column Ray holds as pickled objects of one shape (lists all 6 sentences long) cannot be cast
    return pd.Series([_scalar(value) for value in column], index=column.index, dtype=object)


def _scalar(value):
    """A list cell as one hashable string: a numeric array (a teacher matrix) by a hash of its bytes (printing its
    floats took 69 us for 36 of them, 1.7 us this way), a list of texts (a ranked list's sentences) joined."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        return hashlib.blake2b(np.ascontiguousarray(value).tobytes(), digest_size=16).hexdigest()
    if isinstance(value, (list, tuple, np.ndarray)):
        return "\x1f".join(map(str, value))
    return value


class CorpusRows:
    """A worker's view of the corpus: the blocks mapped from its node's object store (no copy), rows taken by index
    from one contiguous record batch at a time (Arrow's take on a chunked column would first concatenate its chunks:
    a private copy of the whole column) and converted as Ray Data converts a pandas batch."""

    def __init__(self, corpus: CorpusBlocks):
        tables, self.order = _mapped_files(corpus) if corpus.files else _mapped_blocks(corpus)
        self.blocks = [batch for table in tables for batch in table.to_batches() if batch.num_rows]
        self.starts = np.cumsum([0] + [block.num_rows for block in self.blocks])
        if self.starts[-1] != corpus.rows or len(self.order) != corpus.rows:
            raise RuntimeError(f"the corpus blocks hold {self.starts[-1]} rows, the plan has {corpus.rows}")

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        import pyarrow as pa
        from ray.data.block import BlockAccessor

        positions = self.order[np.asarray(index, dtype=np.int64)]  # row numbers -> positions in the blocks
        block_of = np.searchsorted(self.starts, positions, side="right") - 1
        grouped = np.argsort(block_of, kind="stable")  # grouped by block, then put back in the asked order
        positions, block_of = positions[grouped], block_of[grouped]
        parts = [self.blocks[b].take(positions[block_of == b] - self.starts[b]) for b in np.unique(block_of)]
        part = pa.concat_tables([pa.Table.from_batches([p]) for p in parts], promote_options="default")  # blocks may
        part = part.take(np.argsort(grouped, kind="stable"))  # differ in schema (a column all null in one)
        frame = BlockAccessor.for_block(part).to_pandas()
        return {column: frame[column].to_numpy() for column in frame.columns}


def _mapped_blocks(corpus: CorpusBlocks) -> tuple[list, np.ndarray]:
    """The blocks and the order from the node's object store: read-only, shared with the node's other workers."""
    import ray

    return ray.get(list(corpus.blocks)), ray.get(corpus.order)


def _mapped_files(corpus: CorpusBlocks) -> tuple[list, np.ndarray]:
    """The blocks and the order memory-mapped from the node's copy of the corpus files (made once per node): the
    page cache holds what the node's workers read, shared between them, and the rest stays on disk."""
    import json

    import pyarrow as pa

    from storage.node_cache import node_copy

    local = node_copy(corpus.files, f"corpus-{corpus.files.rstrip('/').split('/')[-2]}")  # <fingerprint>-<columns>
    manifest = json.loads((local / MANIFEST).read_text())
    tables = [pa.ipc.open_file(pa.memory_map(str(local / name))).read_all() for name in manifest["blocks"]]
    return tables, np.load(local / manifest["order"], mmap_mode="r")


class InMemoryRows:
    """``CorpusRows``' interface over columns already in memory (benchmarks and tests of the step without Ray)."""

    def __init__(self, columns: dict[str, np.ndarray]):
        self.columns = columns

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[np.asarray(index, dtype=np.int64)] for k, v in self.columns.items()}


@dataclass(frozen=True)
class MicroBatch:
    rows: dict[str, np.ndarray]  # the corpus rows, as Ray Data's pandas batches give them
    prepared: Any  # what the feed's ``prepare`` made of them (the tokenised inputs of their forward passes)


class MicroBatchFeed:
    """This worker's micro-batches in training order: rows taken, then ``prepare``d (tokenised), the next one in a
    background thread while the current one trains (``prefetch``; else in the step). ``wait_s`` counts the time the
    loop still waited."""

    def __init__(self, rows: CorpusRows, plan: StepPlan, seed: int, rank: int,
                 prepare: Callable[[dict[str, np.ndarray]], Any] = lambda rows: None, prefetch: bool = True,
                 draw: Callable[[dict[str, np.ndarray], int, np.ndarray], dict[str, np.ndarray]] | None = None):
        self.rows, self.plan, self.seed, self.rank, self.prepare = rows, plan, seed, rank, prepare
        self.draw = draw  # (rows, step, their corpus row numbers) -> the rows this step trains on (query groups)
        self.prefetch = prefetch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raoe-feed")
        self._pending: tuple[tuple[int, int], Future] | None = None
        self.wait_s = 0.0  # time the loop waited for rows since the last ``take_wait``

    def next(self, step: int, micro: int) -> MicroBatch:
        """Micro-batch ``micro`` of optimizer step ``step`` (0-based); starts preparing the one after."""
        started = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == (step, micro):
            batch = pending[1].result()
        else:
            batch = self._micro_batch(step, micro)
        self.wait_s += time.perf_counter() - started
        following = (step, micro + 1) if micro + 1 < self.plan.grad_accum else (step + 1, 0)
        if self.prefetch and following[0] < self.plan.total_steps:
            self._pending = (following, self._pool.submit(self._micro_batch, *following))
        return batch

    def settle(self) -> None:
        """Wait for the micro-batch being prepared (before the loop tokenises on its own: evaluation, export)."""
        if self._pending is not None:
            self._pending[1].exception()

    def take_wait(self) -> float:
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _micro_batch(self, step: int, micro: int) -> MicroBatch:
        index = self.plan.micro_rows(self.seed, step, micro, self.rank)
        rows = self.rows.take(index)
        if self.draw is not None:
            rows = self.draw(rows, step, index)
        return MicroBatch(rows, self.prepare(rows))
