"""Ranked lists (post-training with ListMLE): each list's teacher similarity matrix computed once on the driver's
Ray Data pipeline (``ListTeacher``; kept in the corpus cache with data.cache), and the worker's batch of whole lists
padded into [lists, longest, d]."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from data_pipelines.teachers import TeacherConfig, TeacherEncoder
from encoders.backbone import build_encoder, inference_embeddings
from encoders.devices import actor_device, pool_resources
from encoders.model_uris import resolve_model
from objectives.composite import EmbeddingBatch
from objectives.gather import gather_no_grad, gather_with_grad
from storage.paths import join
from training.kinds.base import BatchContext, EncodeCall
from training.kinds.kind import corpus_cache_dir


class ListTeacher:
    """Ray Data actor: the teacher's cosine matrix of each list's sentences, flattened row-major (the ListMLE
    targets are refined from it during training). With ``encoder`` (build_encoder's arguments from the model section)
    the teacher is the start model encoding exactly as the training encoder does at step 0: its pooling, prompt
    template, padding side and max length; else a named teacher (posttrain.teacher) as sentence-transformers loads it."""

    def __init__(self, source: str, batch_size: int, trust_remote_code: bool = False, encoder: dict | None = None,
                 gpus: float = 0.0):
        device = actor_device(gpus)
        if encoder is not None:
            model = build_encoder(source, trust_remote_code=trust_remote_code, device=device, **encoder)
            model.eval()
            self.encode = lambda sentences: inference_embeddings(model, sentences, batch_size)
        else:
            self.encode = TeacherEncoder(TeacherConfig(name="teacher", source=source, batch_size=batch_size,
                                                       trust_remote_code=trust_remote_code), device).encode

    def __call__(self, batch):
        """An Arrow batch of lists -> the same with ``teacher_sim``: one flat n*n float32 list per list of n
        sentences. Plain Arrow list columns, so the corpus cache keeps them as Parquet lists (a column of Python
        objects would be pickled, which Ray refuses to read back)."""
        import pyarrow as pa

        sims = []
        for sentences in batch["sentences"].to_pylist():
            emb = np.asarray(self.encode([str(s) for s in sentences]), dtype=np.float64)
            emb = emb / np.linalg.norm(emb, axis=1, keepdims=True).clip(min=1e-12)
            sims.append((emb @ emb.T).astype(np.float32).ravel())
        offsets = np.cumsum([0] + [len(s) for s in sims], dtype=np.int64)
        flat = pa.array(np.concatenate(sims) if sims else np.zeros(0, np.float32))
        return pa.table({"sentences": batch["sentences"],
                         "teacher_sim": pa.LargeListArray.from_arrays(pa.array(offsets), flat)})


def teacher_trusts_code(cfg) -> bool:
    """posttrain.teacher_trust_remote_code, or model.trust_remote_code when unset (the teacher defaults to the
    start model, which then needs the same permission)."""
    remote = cfg.posttrain.teacher_trust_remote_code
    return cfg.model.trust_remote_code if remote is None else remote


def list_teacher_kwargs(cfg, start_model: str) -> dict:
    """ListTeacher's arguments: ``posttrain.teacher`` as named, or the frozen start model built as training builds
    it (without dropout, adapters or quantization: a new LoRA adapter is zero at step 0)."""
    kwargs = {"source": resolve_model(cfg.posttrain.teacher or start_model), "batch_size": 64,
              "trust_remote_code": teacher_trusts_code(cfg), "gpus": cfg.posttrain.teacher_gpus}
    if cfg.posttrain.teacher is None:
        model = cfg.model
        kwargs["encoder"] = model.encoder_kwargs()
    return kwargs


def lists_with_teacher(ds, cfg, start_model: str):
    """Each ranked list with its teacher similarity matrix: ``posttrain.teacher``, or the start model, frozen. With
    the corpus cache on (data.cache), the scored lists are kept beside the validated corpus, keyed by the lists'
    content and the teacher (``teacher_key``): a rerun, a resubmission or a sweep trial reads them back instead of
    encoding every list again."""
    from data_pipelines.corpus_cache import after_use, read_cached, write_cached

    kwargs = list_teacher_kwargs(cfg, start_model)
    cache = corpus_cache_dir(cfg)
    entry = join(cache, f"lists-teacher-{teacher_key(ds, kwargs)}") if cache else None
    cached = read_cached(entry, None) if entry else None
    if cached is not None:
        after_use(entry, cfg.data.cache_max_gb, wrote=False)
        print(f"[raoe] teacher similarity matrices from the cache {entry} (same lists, same teacher)", flush=True)
        return cached[0]
    scored = _scored(ds, kwargs, cfg.posttrain).materialize()
    if entry and write_cached(entry, scored, {"rows_written": scored.count()}):
        after_use(entry, cfg.data.cache_max_gb, wrote=True)
    return scored


def _scored(ds, kwargs: dict, posttrain):
    import ray

    return ds.map_batches(ListTeacher, fn_constructor_kwargs=kwargs, batch_size=64,
                          compute=ray.data.ActorPoolStrategy(size=posttrain.teacher_actors),
                          **pool_resources(posttrain.teacher_cpus, posttrain.teacher_gpus), batch_format="pyarrow")


def teacher_key(ds, kwargs: dict) -> str:
    """What decides the teacher matrices: the lists' content (their fingerprint, whatever their files or order), the
    teacher's files and how it encodes (``ListTeacher``'s arguments, not its devices or pool size), and the code and
    library versions that encode."""
    import sentence_transformers
    import transformers

    from evaluation.corpus_index import model_fingerprint
    from training.rows import content_ordered

    code = hashlib.sha1()
    for module in (__file__, inspect.getfile(build_encoder), inspect.getfile(TeacherEncoder)):
        code.update(Path(module).read_bytes())
    teacher = {k: v for k, v in kwargs.items() if k != "gpus"} | {"source": model_fingerprint(kwargs["source"])}
    identity = {"lists": content_ordered(ds.materialize()).fingerprint, "code": code.hexdigest(), "teacher": teacher,
                "versions": [torch.__version__, transformers.__version__, sentence_transformers.__version__]}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _list_texts(ctx: BatchContext, rows: dict[str, np.ndarray]) -> tuple[list[list[str]], int]:
    """The lists' sentences and the forward passes they take. Every worker holds len(lists) lists (the micro-batch)
    of 2 sentences or more, whatever their lengths: bucket by that floor, not by this worker's own sentence count,
    so all run the same number of forward passes."""
    lists = [[str(s) for s in sentences] for sentences in rows["sentences"]]
    return lists, ctx.length_buckets if len(lists) >= ctx.length_buckets else 1


def lists_calls(ctx: BatchContext, rows: dict[str, np.ndarray]) -> list[EncodeCall]:
    lists, buckets = _list_texts(ctx, rows)
    return [([s for sentences in lists for s in sentences], buckets, None)]


def lists_embed(ctx: BatchContext, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Every sentence of the lists through the encoder, flat in list order."""
    lists, buckets = _list_texts(ctx, rows)
    return {"sentences": ctx.encode([s for sentences in lists for s in sentences], buckets)}


def lists_batch(ctx: BatchContext, rows: dict[str, np.ndarray], local: dict[str, torch.Tensor]) -> EmbeddingBatch:
    """The sentences' embeddings gathered with gradient along with the list lengths and teacher matrices, then padded
    into [lists, longest, d] the same way on every worker."""
    lists = [list(sentences) for sentences in rows["sentences"]]
    device = ctx.device
    counts = gather_no_grad(torch.tensor([len(x) for x in lists], device=device))  # every worker holds as many lists
    by_worker = counts.view(-1, len(lists))
    lengths = counts.tolist()
    flat = np.concatenate([np.asarray(t, dtype=np.float32) for t in rows["teacher_sim"]])
    targets = gather_no_grad(torch.from_numpy(flat).to(device), sizes=(by_worker ** 2).sum(dim=1).tolist())
    emb = list(torch.split(gather_with_grad(local["sentences"], sizes=by_worker.sum(dim=1).tolist()), lengths))
    matrices = [t.view(n, n) for t, n in zip(torch.split(targets, [n * n for n in lengths]), lengths)]
    longest = max(lengths)
    target = torch.zeros(len(lengths), longest, longest, device=device)
    mask = torch.zeros(len(lengths), longest, dtype=torch.bool, device=device)
    for r, (m, n) in enumerate(zip(matrices, lengths)):
        target[r, :n, :n], mask[r, :n] = m, True
    return EmbeddingBatch(list_emb=pad_sequence(emb, batch_first=True), list_mask=mask, list_target=target)
