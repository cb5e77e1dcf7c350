"""Embed a corpus with a trained model on a Ray Data actor pool, shard by shard, resumable.

A shard is one read span of the input (a file, or a 16 MB run of lines or Parquet row groups of a large one: the
reader's own spans), named by the file's content digest and the span, so the same input plans the same shards on every
run. The actor that encodes a shard also reads it (no shuffle, no text on the driver) and writes it whole:
``npy/<shard>.npy`` (float32 rows) first, then ``data/<shard>.parquet`` (``id``, ``text_hash``, ``embedding``), which
commits it; ``data/`` alone is then a Parquet dataset any reader opens. A rerun plans the shards again and hands the
actors only those without their Parquet file: a killed job loses at most the shards in flight. ``spec.json``, written
before any shard, says which model and settings the shards hold; a rerun with another model or settings into the
same folder is refused rather than mixing two models' vectors.

Inputs: a BEIR folder (its corpus.jsonl: ``id`` is the document's ``_id``, the text "title text" as the evaluators
embed it), JSON lines of ``{"_id", "text", "title"?}``, or any sentences corpus raoe reads (txt, JSON lines of
``{"text"}``, Parquet), where ``id`` is ``<file>:<line>`` (the file relative to ``data.train``, its 1-based line or
Parquet row)."""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data_pipelines.formats import SPLITTABLE, Span, _json_records, detect_format, parse, read_spans
from data_pipelines.readers import SPAN_BYTES, BadDataError, corpus_files
from encoders.devices import EncoderPool, pool_resources, shard_pool
from storage.digests import content_digests
from storage.paths import files_under, join, storage_path, write_whole

DATA, VECTORS = "data", "npy"  # the Parquet shards (a dataset of their own), the same vectors as .npy matrices
SPEC = "spec.json"  # the model and settings every shard of the folder holds; written before the first shard
MANIFEST = "manifest.json"  # written last: the shards of the finished corpus, rows and dimension
BEIR_JSONL = "beir_jsonl"  # JSON lines with _id (a BEIR corpus.jsonl): its ids are the documents' own
SPEC_VERSION = 2  # 2: shard names include the file's name (two files of the same bytes are two shards)


@dataclass(frozen=True)
class PlannedShard:
    """One read span of one input file, and the name its output files take."""

    name: str
    path: str  # the file (local path or URI)
    label: str  # the file as ids name it: relative to data.train
    fmt: str
    split: str | None  # of a SentEval NLI folder
    start: int | None  # the span (None: the whole file)
    end: int | None
    first_line: int | None


@dataclass(frozen=True)
class EmbedSettings:
    """What every shard is encoded with (``spec.json`` records it, with the model's fingerprint)."""

    model_path: str
    side: str | None  # the model's query or document prompt and length; None: model.prompt and max_length
    normalize: bool
    batch_size: int
    gpus_per_actor: float
    on_bad_record: str  # fail | quarantine
    runtime: str = "torch"  # or an export's format (encoders/export.py), built once per node into the cache


def plan_shards(source: str, fmt: str = "auto", split: str | None = None) -> tuple[list[PlannedShard], str]:
    """(the shards of ``source`` in input order, its format(s)): a BEIR folder's corpus.jsonl, or a sentences corpus,
    each file read by its own format where ``fmt`` is auto (a folder may hold txt and JSON lines side by side)."""
    if str(source).startswith("hf:"):
        raise ValueError(f"data.train {source!r}: the embed job reads files (local or object storage) so that a rerun "
                         f"finds the same shards; save the dataset as JSON lines or Parquet first")
    root = storage_path(source)
    if root.is_dir() and (root / "corpus.jsonl").exists():
        files, formats = [root / "corpus.jsonl"], [BEIR_JSONL]
    else:
        files, first = corpus_files(source, "sentences", fmt)
        formats = [_file_format(f, fmt, first) for f in files]
    # remembered per file: a rerun on unchanged files hashes nothing (a SentEval folder: its split's s1 and s2)
    digests = [json.dumps(content_digests(sorted(files[0].glob(f"s?.{split or 'train'}"))))] \
        if formats == ["senteval_nli"] else content_digests(files)
    shards = []
    for file, file_fmt, digest in zip(files, formats, digests):
        label = file.name if file == root else Path(str(file)).relative_to(Path(str(root))).as_posix()
        splittable = file_fmt == BEIR_JSONL or file_fmt in SPLITTABLE["sentences"]
        spans = read_spans("jsonl" if file_fmt == BEIR_JSONL else file_fmt, file, SPAN_BYTES) if splittable else [None]
        for span in spans:
            where = [None, None, None] if span is None else [span.start, span.end, span.first_line]
            name = hashlib.sha1(json.dumps([label, digest, file_fmt, split, *where]).encode()).hexdigest()[:20]
            shards.append(PlannedShard(name, str(file), label, file_fmt, split, *where))
    return shards, "+".join(dict.fromkeys(formats))


def _file_format(path, fmt: str, folder_fmt: str) -> str:
    """A file's reader: the configured one, else its own by name (and JSON lines with _id: a BEIR corpus)."""
    if folder_fmt == "senteval_nli":
        return folder_fmt
    own = detect_format("sentences", path) if fmt == "auto" else fmt
    return BEIR_JSONL if own == "jsonl" and _has_beir_ids(path) else own


def _has_beir_ids(path) -> bool:
    for _, _, value, error in _json_records(storage_path(path)):
        return error is None and "_id" in value
    return False


def shard_rows(shard: PlannedShard) -> tuple[list[str], list[str], list[dict]]:
    """(ids, texts, bad rows {source, line, reason, raw}) of one shard, in file order."""
    from evaluation.retrieval import corpus_text

    path = storage_path(shard.path)
    span = None if shard.start is None else Span(shard.start, shard.end, shard.first_line)
    ids, texts, bad = [], [], []
    if shard.fmt == BEIR_JSONL:
        for line, raw, value, error in _json_records(path, span):
            if error is None and ("_id" not in value or not corpus_text(value)):
                error = "a corpus row needs _id and a non-empty text or title"
            if error:
                bad.append({"source": shard.path, "line": line, "reason": error, "raw": raw[:2000]})
                continue
            ids.append(str(value["_id"]))
            texts.append(corpus_text(value))
        return ids, texts, bad
    for row in parse("sentences", shard.fmt, path, shard.split, span):
        if row.get("skipped"):
            continue
        if row["error"]:
            bad.append({"source": row["source"], "line": row["line"], "reason": row["error"], "raw": row["raw"]})
            continue
        where = shard.label if row["source"] == shard.path else f"{shard.label}/{Path(row['source']).name}"
        ids.append(f"{where}:{row['line']}")
        texts.append(row["text"])
    return ids, texts, bad


def text_hashes(texts: list[str]) -> list[str]:
    """The first 16 hex digits of each text's sha1 (the text as read, before any prompt): what says a row changed."""
    return [hashlib.sha1(t.encode("utf-8")).hexdigest()[:16] for t in texts]


def finished_shards(folder: str) -> set[str]:
    """The shards whose Parquet file (written last) is in ``folder``: one listing, local or object storage."""
    return {name[: -len(".parquet")] for name, _, _ in files_under(storage_path(join(folder, DATA)))
            if name.endswith(".parquet") and "/" not in name}


def remove_shards(folder: str, names: list[str]) -> None:
    """Delete shards (their Parquet first: a half-removed shard counts as unfinished), vectors and quarantine."""
    for name in names:
        for part, ext in ((DATA, "parquet"), (VECTORS, "npy"), ("quarantine", "jsonl")):
            target = storage_path(join(folder, part, f"{name}.{ext}"))
            if target.exists():
                target.unlink()


def check_spec(folder: str, spec: dict) -> None:
    """Write ``spec.json`` into a new folder; refuse a folder whose shards hold another model's or settings' vectors."""
    target = storage_path(join(folder, SPEC))
    if target.exists():
        held = json.loads(target.read_text())
        differ = {k: (held.get(k), spec.get(k)) for k in [*spec, *(k for k in held if k not in spec)]
                  if held.get(k) != spec.get(k)}  # a setting recorded on one side only differs too
        if differ:
            listed = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
            raise ValueError(f"output_dir {folder} holds embeddings made otherwise ({listed}): give another output_dir, "
                             f"or remove it to start again")
        return
    write_whole(join(folder, SPEC), json.dumps(spec, indent=1))


class ShardEmbedder:
    """A Ray Data actor holding one model: reads each shard handed to it, encodes it and writes its files."""

    def __init__(self, settings: EmbedSettings, folder: str):
        from evaluation.encode import SentenceEncoderActor

        self.encoder = SentenceEncoderActor(settings.model_path, settings.batch_size, settings.gpus_per_actor,
                                            normalise=settings.normalize, side=settings.side, runtime=settings.runtime)
        self.width = int(self.encoder.model.get_embedding_dimension())  # an empty shard's vectors have it too
        self.settings, self.folder = settings, folder

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        done = {"shard": [], "rows": [], "bad": [], "seconds": [], "dim": []}
        for item in batch["shard"]:
            started = time.perf_counter()
            shard = PlannedShard(**json.loads(item))
            ids, texts, bad = shard_rows(shard)
            if bad and self.settings.on_bad_record == "fail":
                first = bad[0]
                raise BadDataError(f"{len(bad)} bad row(s) in {shard.path} (set data.on_bad_record=quarantine to set "
                                   f"them aside), the first at line {first['line']}: {first['reason']}")
            if bad:
                write_whole(join(self.folder, "quarantine", f"{shard.name}.jsonl"),
                            "".join(json.dumps(b) + "\n" for b in bad))
            emb = self.encoder({"text": np.array(texts, dtype=object)})["embedding"] if texts else \
                np.zeros((0, self.width), np.float32)
            write_shard(self.folder, shard.name, ids, text_hashes(texts), emb)
            done["shard"].append(shard.name)
            done["rows"].append(len(ids))
            done["bad"].append(len(bad))
            done["seconds"].append(time.perf_counter() - started)
            done["dim"].append(int(emb.shape[1]))
        return done


def write_shard(folder: str, name: str, ids: list[str], hashes: list[str], emb: np.ndarray) -> None:
    """``npy/<name>.npy`` then ``data/<name>.parquet`` (the commit), each seen whole or not at all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    emb = np.ascontiguousarray(emb, dtype=np.float32)
    buffer = io.BytesIO()
    np.save(buffer, emb)
    write_whole(join(folder, VECTORS, f"{name}.npy"), buffer.getvalue())
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1), pa.float32()), emb.shape[1])
    table = pa.table({"id": pa.array(ids, pa.string()), "text_hash": pa.array(hashes, pa.string()),
                      "embedding": vectors})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    write_whole(join(folder, DATA, f"{name}.parquet"), sink.getvalue())


def embed_shards(todo: list[PlannedShard], settings: EmbedSettings, folder: str, pool: EncoderPool) -> list[dict]:
    """Encode and write ``todo`` on the actor pool, one shard per call; (shard, rows, bad, seconds, dim) of each."""
    import ray

    if not todo:
        return []
    items = [{"shard": json.dumps(asdict(s))} for s in todo]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    actors = min(pool.actors, len(todo))  # an actor with no shard would load the model for nothing
    written = ds.map_batches(ShardEmbedder, batch_size=1, compute=shard_pool(actors),
                             fn_constructor_args=(settings, folder),
                             **pool_resources(pool.cpus_per_actor, pool.gpus_per_actor))
    return written.take_all()


def finished_embeddings(folder: str) -> tuple[dict, dict]:
    """(spec, manifest) of a finished embed output folder (its spec.json; its manifest: ``shards`` with their rows,
    ``dim``); refused by name when the folder is not one."""
    manifest = storage_path(join(folder, MANIFEST))
    if not manifest.exists():
        raise FileNotFoundError(f"{folder} holds no finished embeddings (no {MANIFEST}): run ray_jobs/embed.py into "
                                f"it to the end first")
    return json.loads(storage_path(join(folder, SPEC)).read_text()), json.loads(manifest.read_text())


def shard_vectors(folder: str, shard: str) -> np.ndarray:
    """The float32 vectors of one shard of an embed output folder (its .npy), local or on object storage."""
    with storage_path(join(folder, VECTORS, f"{shard}.npy")).open("rb") as f:
        return np.load(io.BytesIO(f.read()))
