"""Kinds of training data, each in one place: which corpus it reads, which EmbeddingBatch fields it can fill, and
how a worker's micro-batch becomes the gathered (global) batch: how many forward passes, with which dropout.

The Ray Train loop and the driver only name a kind; adding one (ranked lists, relation triples) touches this file.
Every worker gathers the same fields in the same order, decided by the driver from the config, whatever its own
rows hold (else the all-gathers misalign or hang)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# Where scores and labels come from in a corpus row.
FIELD_COLUMNS = {"scores": "similarity", "labels": "label"}


@dataclass(frozen=True)
class DataKind:
    name: str
    corpus: str  # the reader's kind (data_pipelines.formats.KINDS)
    provides: tuple[str, ...]  # EmbeddingBatch fields this data can fill
    build: Callable[..., object]  # (module, model, rows, device, autocast, buckets, fields, dropout) -> EmbeddingBatch
    unit: str = "pairs"  # what one row is, for progress lines
    corpus_to_rows: Callable[..., object] | None = None  # (validated corpus, job config, start model) -> rows
    # A corpus that is not one data.train (RSE's mix of sources): (job config, quarantine path) ->
    # (Ray Dataset of training rows, DataReport, extras for the workers and for ``finish``)
    load: Callable[..., tuple] | None = None
    setup_model: Callable[..., None] | None = None  # (model, extras, start folder, seed) on every worker
    finish: Callable[..., dict] | None = None  # (job config, model folder, extras, output folder) -> metrics

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


@contextlib.contextmanager
def dropout_rate(model: torch.nn.Module, p: float | None):
    """Every dropout of the encoder at rate ``p`` inside the block (SAN's p2 for aligned negatives), restored after.
    Under gradient checkpointing the backward recomputes these layers at the same rate (encoders.backbone's
    DropoutReplay)."""
    from encoders.backbone import dropout_settings, dropout_settings_applied

    if p is None:
        yield
        return
    with dropout_settings_applied([(module, name, p) for module, name, _ in dropout_settings(model)]):
        yield


def _encode(module, model, texts: list[str], device, autocast, buckets: int) -> torch.Tensor:
    """Each forward pass is a collective (DDP broadcasts buffers, ZeRO-3 gathers weights), so every worker must run
    as many: ``embed_by_length`` runs ``buckets`` passes for 2 x ``buckets`` texts or more, so a caller whose text
    count differs between workers (ranked lists) chooses ``buckets`` from a count every worker holds."""
    from encoders.backbone import embed_by_length

    with autocast or contextlib.nullcontext():
        return embed_by_length(module, model, texts, device, buckets).float()


def _gather_fields(rows: dict[str, np.ndarray], fields: tuple[str, ...], device) -> dict[str, torch.Tensor]:
    """Scores (None -> NaN, which the objective refuses by name) and labels (None -> -1, likewise)."""
    from objectives.gather import gather_no_grad

    out = {}
    if "scores" in fields:
        scores = np.array([np.nan if v is None else v for v in rows[FIELD_COLUMNS["scores"]]], dtype=np.float32)
        out["scores"] = gather_no_grad(torch.from_numpy(scores).to(device))
    if "labels" in fields:
        labels = np.array([-1 if v is None else v for v in rows[FIELD_COLUMNS["labels"]]], dtype=np.int64)
        out["labels"] = gather_no_grad(torch.from_numpy(labels).to(device))
    return out


def _ids(texts: list[str], device) -> torch.Tensor:
    from encoders.backbone import text_ids
    from objectives.gather import gather_no_grad

    return gather_no_grad(text_ids(texts).to(device))


def text_pairs_batch(module, model, rows: dict[str, np.ndarray], device, autocast=None, buckets: int = 1,
                     fields: tuple[str, ...] = ("scores", "labels"), negative_dropout: float | None = None):
    """Pairs (NLI with S, STS) and SimCSE triplets: both texts (and the hard negative) through the encoder together,
    in ``buckets`` length-grouped passes; embeddings gathered with gradient."""
    from objectives.gather import gather_with_grad
    from objectives.registry import EmbeddingBatch

    text1, text2 = [str(t) for t in rows["text1"]], [str(t) for t in rows["text2"]]
    negatives = [str(t) for t in rows["text_neg"]] if "text_neg" in rows else []
    every = _encode(module, model, text1 + text2 + negatives, device, autocast, buckets)
    n = len(text1)
    return EmbeddingBatch(
        emb1=gather_with_grad(every[:n]), emb2=gather_with_grad(every[n: 2 * n]),
        emb_neg=gather_with_grad(every[2 * n:]) if negatives else None,
        ids1=_ids(text1, device), ids2=_ids(text2, device), **_gather_fields(rows, fields, device),
    )


def sentences_batch(module, model, rows: dict[str, np.ndarray], device, autocast=None, buckets: int = 1,
                    fields: tuple[str, ...] = (), negative_dropout: float | None = None):
    """Unsupervised SimCSE: each sentence twice through the encoder in one pass, so dropout (``model.dropout``)
    makes the two views its anchor and positive. With a ``negative`` column (SAN), the aligned negatives go through
    a pass of their own at dropout ``negative_dropout`` (the paper's p2)."""
    from objectives.gather import gather_no_grad, gather_with_grad
    from objectives.registry import EmbeddingBatch

    texts = [str(t) for t in rows["text"]]
    views = _encode(module, model, texts + texts, device, autocast, buckets)
    n = len(texts)
    negative = mask = None
    if "negative" in rows:  # an anchor the SAN guard left without a negative encodes itself there, masked out:
        present = [isinstance(t, str) and bool(t) for t in rows["negative"]]  # every worker runs this pass
        negatives = [str(t) if real else anchor for t, real, anchor in zip(rows["negative"], present, texts)]
        with dropout_rate(model, negative_dropout):
            negative = gather_with_grad(_encode(module, model, negatives, device, autocast, buckets))
        mask = gather_no_grad(torch.tensor(present, dtype=torch.bool, device=device))
    ids = _ids(texts, device)
    return EmbeddingBatch(emb1=gather_with_grad(views[:n]), emb2=gather_with_grad(views[n:]), emb_neg=negative,
                          neg_mask=mask, ids1=ids, ids2=ids)


def _triplets(ds, cfg, start_model: str):
    """NLI pairs -> (premise, entailment, contradiction), then shuffled with a seed (they come sorted by premise)
    before data.max_rows, which counts triplets here: a pair subsample would break the groups."""
    from data_pipelines.triplets import nli_triplets

    ds = nli_triplets(ds).random_shuffle(seed=cfg.data.shuffle_seed or cfg.trainer.seed)
    return ds.limit(cfg.data.max_rows) if cfg.data.max_rows is not None else ds


def _sentences(ds, cfg, start_model: str):
    return ds.select_columns(["text"])  # a SAN corpus trains plain SimCSE too: its negatives stay behind


def _sentences_with_negatives(ds, cfg, start_model: str):
    """Every sentence trains, with or without its aligned negative (the paper trains SimCSE+SAN on all of Wiki1M;
    HiNCE leaves a missing negative out of the softmax). A corpus with none is refused: it would be plain SimCSE."""
    total, missing = ds.count(), ds.filter(lambda r: not r["negative"]).count()
    if missing == total:
        raise ValueError(f"the {total} sentences of {cfg.data.train} have no 'negative'; the objective (hince) needs "
                         f"aligned negatives: generate them with ray_jobs/generate_san.py")
    if missing:
        print(f"[raoe] {missing} of {total} sentences have no aligned negative (guarded by generate_san): they train "
              f"with in-batch candidates only", flush=True)
    return ds.select_columns(["text", "negative"])


class ListTeacher:
    """Ray Data actor: the teacher's cosine matrix of each list's sentences, flattened row-major (the ListMLE
    targets are refined from it during training). With ``encoder`` (build_encoder's arguments from the model section)
    the teacher is the start model encoding exactly as the training encoder does at step 0: its pooling, prompt
    template, padding side and max length; else a named teacher (posttrain.teacher) as sentence-transformers loads it."""

    def __init__(self, source: str, batch_size: int, trust_remote_code: bool = False, encoder: dict | None = None):
        if encoder is not None:
            from encoders.backbone import build_encoder, encode_texts

            model = build_encoder(source, trust_remote_code=trust_remote_code, **encoder)
            model.eval()
            self.encode = lambda sentences: encode_texts(model, sentences, batch_size)
        else:
            from data_pipelines.teachers import TeacherConfig, TeacherEncoder

            self.encode = TeacherEncoder(TeacherConfig(name="teacher", source=source, batch_size=batch_size,
                                                       trust_remote_code=trust_remote_code)).encode

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sims = []
        for sentences in batch["sentences"]:
            emb = np.asarray(self.encode([str(s) for s in sentences]), dtype=np.float64)
            emb = emb / np.linalg.norm(emb, axis=1, keepdims=True).clip(min=1e-12)
            sims.append((emb @ emb.T).astype(np.float32).ravel())
        column = np.empty(len(sims), dtype=object)  # one flat n*n array per list, lists of any length
        for i, sim in enumerate(sims):
            column[i] = sim
        return {"sentences": batch["sentences"], "teacher_sim": column}


def teacher_trusts_code(cfg) -> bool:
    """posttrain.teacher_trust_remote_code, or model.trust_remote_code when unset (the teacher defaults to the
    start model, which then needs the same permission)."""
    remote = cfg.posttrain.teacher_trust_remote_code
    return cfg.model.trust_remote_code if remote is None else remote


def list_teacher_kwargs(cfg, start_model: str) -> dict:
    """ListTeacher's arguments: ``posttrain.teacher`` as named, or the frozen start model built as training builds
    it (without dropout, adapters or quantization: a new LoRA adapter is zero at step 0)."""
    from encoders.model_uris import resolve_model

    kwargs = {"source": resolve_model(cfg.posttrain.teacher or start_model), "batch_size": 64,
              "trust_remote_code": teacher_trusts_code(cfg)}
    if cfg.posttrain.teacher is None:
        model = cfg.model
        kwargs["encoder"] = {"pooling": model.pooling, "max_length": model.max_length, "prompt": model.prompt,
                             "padding_side": model.padding_side}
    return kwargs


def _lists(ds, cfg, start_model: str):
    """Each ranked list with its teacher similarity matrix: ``posttrain.teacher``, or the start model, frozen."""
    import ray

    return ds.map_batches(ListTeacher, fn_constructor_kwargs=list_teacher_kwargs(cfg, start_model),
                          batch_size=64, compute=ray.data.ActorPoolStrategy(size=1),
                          num_cpus=cfg.posttrain.teacher_cpus, batch_format="numpy")


def lists_batch(module, model, rows: dict[str, np.ndarray], device, autocast=None, buckets: int = 1,
                fields: tuple[str, ...] = (), negative_dropout: float | None = None):
    """Ranked lists: every sentence of the worker's lists through the encoder, gathered with gradient along with
    the list lengths and teacher matrices, then padded into [lists, longest, d] the same way on every worker."""
    from torch.nn.utils.rnn import pad_sequence

    from objectives.gather import gather_no_grad, gather_with_grad
    from objectives.registry import EmbeddingBatch

    lists = [[str(s) for s in sentences] for sentences in rows["sentences"]]
    # Every worker holds len(lists) lists (the micro-batch) of 2 sentences or more, whatever their lengths: bucket
    # by that floor, not by this worker's own sentence count, so all run the same number of forward passes.
    buckets = buckets if len(lists) >= buckets else 1
    local = _encode(module, model, [s for sentences in lists for s in sentences], device, autocast, buckets)
    lengths = gather_no_grad(torch.tensor([len(x) for x in lists], device=device)).tolist()
    flat = np.concatenate([np.asarray(t, dtype=np.float32) for t in rows["teacher_sim"]])
    targets = gather_no_grad(torch.from_numpy(flat).to(device))
    emb = list(torch.split(gather_with_grad(local), lengths))
    matrices = [t.view(n, n) for t, n in zip(torch.split(targets, [n * n for n in lengths]), lengths)]
    longest = max(lengths)
    target = torch.zeros(len(lengths), longest, longest, device=device)
    mask = torch.zeros(len(lengths), longest, dtype=torch.bool, device=device)
    for r, (m, n) in enumerate(zip(matrices, lengths)):
        target[r, :n, :n], mask[r, :n] = m, True
    return EmbeddingBatch(list_emb=pad_sequence(emb, batch_first=True), list_mask=mask, list_target=target)


def _load_triples(cfg, quarantine_path):
    """RSE: every source as triples, then held-out slice, caps, weights and hard negatives (seeded)."""
    import ray

    from data_pipelines.relations import load_triples, prepare_triples

    frame, report = load_triples(cfg.data, quarantine_path)
    triples = prepare_triples(frame, cfg.data, cfg.trainer.seed)
    unknown = sorted(set(cfg.eval.relation_weights or {}) - set(triples.relations))
    if unknown:  # else the first dev evaluation fails in a worker, the steps before it lost
        raise ValueError(f"eval.relation_weights names relation(s) {unknown} that the training triples do not hold; "
                         f"their relations: {list(triples.relations)}")
    print(f"[raoe] relations {triples.counts} (training triples), {len(triples.heldout)} held out", flush=True)
    columns = ["head", "tail", "negative", "relation_id"]
    extras = {"relations": triples.relations, "relation_lr": cfg.relational.relation_lr,
              "init_std": cfg.relational.init_std, "heldout": triples.heldout.to_dict("records"),
              "counts": triples.counts}
    return ray.data.from_pandas(triples.train[columns]).materialize(), report, extras


def _relation_table(model, extras: dict, start_folder: str | None, seed: int) -> None:
    from encoders.relation_table import TABLE, attach_relation_table

    attach_relation_table(model, extras["relations"], start_folder, init_std=extras["init_std"], seed=seed)
    table = getattr(model, TABLE)
    table.raoe_lr = extras["relation_lr"]  # its own optimizer group (training/strategy.py), no weight decay
    table.raoe_watch = TABLE  # its gradient norm is logged per step as grad_norm/relation_vectors


def _relation_report(cfg, model_dir, extras: dict, out_dir) -> dict:
    """After training: relation prediction on the held-out triples and the relation-vector cosine plot."""
    import json
    from pathlib import Path

    from encoders.relational import RelationalEncoder, plot_relation_similarity, relation_prediction

    encoder = RelationalEncoder(model_dir)
    plot = plot_relation_similarity(encoder.names, encoder.vectors, Path(out_dir) / "relation_similarity.png")
    out = {"relations": extras["counts"], "relation_similarity_plot": str(plot)}
    if extras["heldout"]:  # kept next to the model, for ray_jobs/evaluate.py --set eval.triples=...
        path = Path(out_dir) / "heldout_triples.jsonl"
        path.write_text("".join(json.dumps({k: t[k] for k in ("head", "relation", "tail")}) + "\n"
                                for t in extras["heldout"]), encoding="utf-8")
        out["heldout_triples"] = str(path)
        out["relation_prediction"] = relation_prediction(encoder.encode, extras["heldout"], encoder.names,
                                                         encoder.vectors)
    return out


def triples_batch(module, model, rows: dict[str, np.ndarray], device, autocast=None, buckets: int = 1,
                  fields: tuple[str, ...] = (), negative_dropout: float | None = None):
    """Relation triples: heads, tails and hard negatives through the encoder together (a same-sent triple's head
    and tail are two dropout views), gathered with gradient; relation ids and text ids gathered; the relation
    table is the model's own parameter, the same full tensor on every worker."""
    from encoders.relation_table import TABLE
    from objectives.gather import gather_no_grad, gather_with_grad
    from objectives.registry import EmbeddingBatch

    head, tail = [str(t) for t in rows["head"]], [str(t) for t in rows["tail"]]
    negative = [str(t) for t in rows["negative"]]
    every = _encode(module, model, head + tail + negative, device, autocast, buckets)
    n = len(head)
    relation = gather_no_grad(torch.as_tensor(np.asarray(rows["relation_id"], dtype=np.int64), device=device))
    return EmbeddingBatch(emb1=gather_with_grad(every[:n]), emb2=gather_with_grad(every[n: 2 * n]),
                          emb_neg=gather_with_grad(every[2 * n:]), ids1=_ids(head, device), ids2=_ids(tail, device),
                          ids_neg=_ids(negative, device), relation=relation, relation_table=getattr(model, TABLE))


KINDS: dict[str, DataKind] = {
    k.name: k for k in [
        DataKind("pairs", "pairs", ("emb1", "emb2", "labels", "scores", "ids1", "ids2"), text_pairs_batch),
        DataKind("sts", "sts", ("emb1", "emb2", "scores", "ids1", "ids2"), text_pairs_batch),
        DataKind("triplets", "pairs", ("emb1", "emb2", "emb_neg", "labels", "scores", "ids1", "ids2"),
                 text_pairs_batch, "SimCSE triplets (premise, entailment, contradiction)", _triplets),
        DataKind("sentences", "sentences", ("emb1", "emb2", "ids1", "ids2"), sentences_batch, "sentences", _sentences),
        DataKind("sentences_san", "sentences", ("emb1", "emb2", "emb_neg", "neg_mask", "ids1", "ids2"), sentences_batch,
                 "sentences with aligned negatives", _sentences_with_negatives),
        DataKind("lists", "lists", ("list_emb", "list_mask", "list_target"), lists_batch, "ranked lists", _lists),
        DataKind("triples", "triples", ("emb1", "emb2", "emb_neg", "ids1", "ids2", "ids_neg", "relation",
                                        "relation_table"), triples_batch, "relation triples",
                 load=_load_triples, setup_model=_relation_table, finish=_relation_report),
    ]
}
