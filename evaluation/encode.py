"""Encode sentences with a Ray Data actor pool: one model load per actor, length-sorted batches."""

from __future__ import annotations

import numpy as np

from encoders.backbone import inference_embeddings, load_encoder
from encoders.devices import EncoderPool, actor_device, pool_resources
from evaluation.search import normalised
from evaluation.sts import evaluate_sts

ONE_ACTOR = EncoderPool()


class SentenceEncoderActor:
    """A Ray Data ``map_batches`` callable class holding one model, loaded as training exported it (so a
    prompt template the sentence-transformers config cannot carry still applies), encoding texts on ``side``
    ('query', 'document' or None: their prompt and max length), with the model itself or one of its exports
    (``runtime``)."""

    def __init__(self, model_path: str, batch_size: int = 64, gpus: float = 0.0, *, keep_text: bool = False,
                 normalise: bool = False, side: str | None = None, runtime: str = "torch"):
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        if runtime == "torch":
            self.model = load_encoder(model_path, device=actor_device(gpus))
        else:  # an export of the model (merged on the actor's device; onnxruntime, OpenVINO on CPU), built once per node
            from encoders.export import cached_export, load_export

            self.model = load_export(cached_export(model_path, runtime), runtime, device=actor_device(gpus))
        self.batch_size, self.keep_text, self.normalise, self.side = batch_size, keep_text, normalise, side

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch's other columns (ids) pass through; ``text`` only when asked to keep it."""
        texts = [str(t) for t in batch["text"]]
        emb = inference_embeddings(self.model, texts, self.batch_size, self.side).astype(np.float32)
        out = {k: v for k, v in batch.items() if k != "text" or self.keep_text}
        out["embedding"] = normalised(emb) if self.normalise else emb
        return out


def ray_encode(model_path: str, sentences: list[str], *, batch_size: int = 64,
               pool: EncoderPool = ONE_ACTOR, side: str | None = None) -> np.ndarray:
    """Embeddings of ``sentences`` (on ``side``) in input order, computed across the Ray cluster."""
    import ray

    if not sentences:
        return np.zeros((0, 0), dtype=np.float32)
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))  # similar lengths share a batch
    items = [{"idx": i, "text": sentences[i]} for i in order]
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items) // batch_size, 8 * pool.actors)))
    out = ds.map_batches(
        SentenceEncoderActor,
        fn_constructor_kwargs={"model_path": model_path, "batch_size": batch_size, "gpus": pool.gpus_per_actor,
                               "side": side},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=pool.actors),
        **pool_resources(pool.cpus_per_actor, pool.gpus_per_actor),
    )
    rows = out.take_all()
    result = np.zeros((len(sentences), len(rows[0]["embedding"])), dtype=np.float32)
    for row in rows:
        result[row["idx"]] = row["embedding"]
    return result


def ray_encoder(model_path: str, batch_size: int, *, pool: EncoderPool = ONE_ACTOR, cache: dict | None = None):
    """``encode(sentences)`` through the Ray actor pool; sentences already in ``cache`` are not encoded again (so
    several scorings of one model, e.g. an RSE model's plain and relation scores, encode each sentence once)."""
    cache = {} if cache is None else cache

    def encode(sentences):
        missing = sorted(set(sentences) - set(cache))
        if missing:
            print(f"encoding {len(missing)} sentences with {pool.actors} actor(s) ...", flush=True)
            cache.update(zip(missing, ray_encode(model_path, missing, batch_size=batch_size, pool=pool)))
        return np.stack([cache[s] for s in sentences]) if sentences else np.zeros((0, 0), dtype=np.float32)

    return encode


def score_with_ray(model_path: str, eval_cfg, *, pool: EncoderPool = ONE_ACTOR, predictions: dict | None = None,
                   score=None, cache: dict | None = None, dim: int | None = None) -> dict:
    """The STS suite of ``eval_cfg`` (an EvalConfig) for one model, encoded by a Ray Data actor pool; ``score``
    replaces the cosine (an RSE model's relation score); ``cache`` shares embeddings between calls (every ``dim``
    cuts the same ones); ``dim``: the model's leading dimensions only (Matryoshka)."""
    whole = ray_encoder(model_path, eval_cfg.batch_size, pool=pool, cache=cache)
    encode = whole if dim is None else (lambda sentences: normalised(whole(sentences), dim))
    return evaluate_sts(encode, eval_cfg.data_dir, eval_cfg.tasks, max_pairs=eval_cfg.max_pairs,
                        stsb_split=eval_cfg.stsb_split, predictions=predictions, score=score)
