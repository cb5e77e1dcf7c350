"""Encode sentences with a Ray Data actor pool: one model load per actor, length-sorted batches."""

from __future__ import annotations

import numpy as np


class SentenceEncoderActor:
    """A Ray Data ``map_batches`` callable class holding one sentence-transformers model."""

    def __init__(self, model_path: str, batch_size: int = 64):
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.model = SentenceTransformer(model_path, device="cpu")
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        emb = self.model.encode(list(batch["text"]), batch_size=self.batch_size, convert_to_numpy=True)
        return {"idx": batch["idx"], "embedding": emb.astype(np.float32)}


def ray_encode(model_path: str, sentences: list[str], *, batch_size: int = 64, actors: int = 1,
               cpus_per_actor: float = 1.0) -> np.ndarray:
    """Embeddings of ``sentences`` in input order, computed across the Ray cluster."""
    import ray

    if not sentences:
        return np.zeros((0, 0), dtype=np.float32)
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))  # similar lengths share a batch
    items = [{"idx": i, "text": sentences[i]} for i in order]
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items) // batch_size, 8 * actors)))
    out = ds.map_batches(
        SentenceEncoderActor,
        fn_constructor_kwargs={"model_path": model_path, "batch_size": batch_size},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=cpus_per_actor,
    )
    rows = out.take_all()
    result = np.zeros((len(sentences), len(rows[0]["embedding"])), dtype=np.float32)
    for row in rows:
        result[row["idx"]] = row["embedding"]
    return result
