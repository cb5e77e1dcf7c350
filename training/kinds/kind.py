"""The table entry of a kind of training data (``DataKind``) and what the driver reads of it before training, free
of torch: the driver checks the config and reads and orders the corpus before it loads torch (a corpus whose every
row is bad fails with the driver at ~330 MB, not ~510), and the batch-building functions (``training.kinds.base`` and
beside it) load on their first call."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from storage.paths import absolute

if TYPE_CHECKING:
    import numpy as np

    from objectives.composite import EmbeddingBatch
    from training.kinds.base import BatchContext, Embeddings, EncodeCall, ModelAdditions

# Where scores and labels come from in a corpus row.
FIELD_COLUMNS = {"scores": "similarity", "labels": "label", "teacher_scores": "teacher_scores"}


def on_first_call(module: str, name: str) -> Callable:
    """``module.name``, imported when first called: the table names every kind's functions, a job calls its own."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.module = module
    return call


@dataclass(frozen=True)
class DataKind:
    """One kind of training data. The driver prepares its rows (``corpus_to_rows`` on the validated corpus, or
    ``load`` for a corpus that is not one ``data.train``), each worker adds its trainable state (``setup_model``),
    encodes each chunk of its rows (``embed``) and gathers its micro-batch into the global batch (``assemble``), and
    the driver reports after training (``finish``)."""

    name: str
    corpus: str  # the reader's corpus kind (data_pipelines.formats.CORPUS_KINDS)
    provides: tuple[str, ...]  # EmbeddingBatch fields this data can fill
    embed: Callable[[BatchContext, dict[str, np.ndarray]], Embeddings]  # one chunk through the encoder
    # (worker's rows, their embeddings) -> the gathered batch: every worker gathers the same fields in the same order
    assemble: Callable[[BatchContext, dict[str, np.ndarray], Embeddings], EmbeddingBatch]
    # The (texts, buckets or None) of every ``ctx.encode`` call ``embed`` makes on a chunk, in order: tokenised
    # ahead by the feed. ``embed`` and its encode_calls read their texts through the same function.
    encode_calls: Callable[[BatchContext, dict[str, np.ndarray]], list[EncodeCall]]
    # Which side each text column is on ('query' or 'document': model.prompts and the side's max length); a column
    # on no side takes model.prompt and model.max_length
    sides: dict[str, str] = field(default_factory=dict)
    unit: str = "pairs"  # what one row is, for progress lines
    corpus_to_rows: Callable[..., object] | None = None  # (validated corpus, job config, start model) -> rows
    # (job config, quarantine path) -> (Ray Dataset of training rows, DataReport, extras for workers and ``finish``)
    load: Callable[..., tuple] | None = None
    setup_model: Callable[..., ModelAdditions] | None = None  # (model, extras, start folder, seed), on every worker
    finish: Callable[..., dict] | None = None  # (job config, model folder, extras, output folder) -> metrics
    # (ctx, corpus rows, seed, step, their corpus row numbers) -> the rows a step trains on, drawn from each corpus row
    # by (seed, step, row) alone (query groups: one positive and group_size - 1 negatives), so 1 = N workers
    draw: Callable[..., dict[str, np.ndarray]] | None = None

    def build(self, ctx: BatchContext, rows: dict[str, np.ndarray]) -> EmbeddingBatch:
        """The gathered batch of ``rows`` encoded as one chunk."""
        return self.assemble(ctx, rows, self.embed(ctx, rows))

    def prepare(self, ds, rows: int, cfg, start_model: str):
        """(training dataset, row count) from the validated corpus of ``rows`` records."""
        if self.corpus_to_rows is None:
            return ds, rows
        ds = self.corpus_to_rows(ds, cfg, start_model).materialize()
        count = ds.count()
        if count == 0:
            raise ValueError(f"none of the {rows} records of {cfg.data.train} gives {self.unit}")
        print(f"[raoe] {count} {self.unit} from {rows} records", flush=True)
        return ds, count


def corpus_cache_dir(cfg) -> str | None:
    """Where validated corpora, and what the driver derives from them at a cost (the lists' teacher matrices), are
    kept (data.cache): beside the checkpoints, on storage every node reaches (a shared folder or an object store)."""
    return f"{absolute(cfg.trainer.storage_path).rstrip('/')}/corpus_cache" if cfg.data.cache else None


