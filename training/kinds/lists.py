"""Ranked lists (post-training with ListMLE): each list's teacher similarity matrix computed once on the driver's
Ray Data pipeline (``ListTeacher``), and the worker's batch of whole lists padded into [lists, longest, d]."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from data_pipelines.teachers import TeacherConfig, TeacherEncoder
from encoders.backbone import build_encoder, inference_embeddings
from encoders.devices import actor_device, pool_resources
from encoders.model_uris import resolve_model
from objectives.composite import EmbeddingBatch
from objectives.gather import gather_no_grad, gather_with_grad
from training.kinds.base import BatchContext


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
    kwargs = {"source": resolve_model(cfg.posttrain.teacher or start_model), "batch_size": 64,
              "trust_remote_code": teacher_trusts_code(cfg), "gpus": cfg.posttrain.teacher_gpus}
    if cfg.posttrain.teacher is None:
        model = cfg.model
        kwargs["encoder"] = {"pooling": model.pooling, "max_length": model.max_length, "prompt": model.prompt,
                             "padding_side": model.padding_side}
    return kwargs


def lists_with_teacher(ds, cfg, start_model: str):
    """Each ranked list with its teacher similarity matrix: ``posttrain.teacher``, or the start model, frozen."""
    import ray

    return ds.map_batches(ListTeacher, fn_constructor_kwargs=list_teacher_kwargs(cfg, start_model),
                          batch_size=64, compute=ray.data.ActorPoolStrategy(size=cfg.posttrain.teacher_actors),
                          **pool_resources(cfg.posttrain.teacher_cpus, cfg.posttrain.teacher_gpus),
                          batch_format="numpy")


def _list_texts(ctx: BatchContext, rows: dict[str, np.ndarray]) -> tuple[list[list[str]], int]:
    """The lists' sentences and the forward passes they take. Every worker holds len(lists) lists (the micro-batch)
    of 2 sentences or more, whatever their lengths: bucket by that floor, not by this worker's own sentence count,
    so all run the same number of forward passes."""
    lists = [[str(s) for s in sentences] for sentences in rows["sentences"]]
    return lists, ctx.length_buckets if len(lists) >= ctx.length_buckets else 1


def lists_calls(ctx: BatchContext, rows: dict[str, np.ndarray]) -> list[tuple[list[str], int | None]]:
    lists, buckets = _list_texts(ctx, rows)
    return [([s for sentences in lists for s in sentences], buckets)]


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
