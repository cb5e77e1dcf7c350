"""Encode sentences with a Ray Data actor pool: one model load per actor, length-sorted batches."""

from __future__ import annotations

import numpy as np

from encoders.backbone import embeddings_by_side, inference_embeddings, load_encoder
from encoders.devices import EncoderPool, actor_device, pool_resources
from evaluation.search import normalised
from evaluation.sts import evaluate_sts

ONE_ACTOR = EncoderPool()
PLURAL = {None: "sentences", "query": "queries", "document": "documents"}  # what a pass encodes, in its progress line


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
        """The batch's other columns (ids) pass through; ``text`` only when asked to keep it. A ``side`` column
        (rows of several sides in one pass; "" for none) replaces the actor's own side, row by row."""
        texts = [str(t) for t in batch["text"]]
        if "side" in batch:
            emb = embeddings_by_side(self.model, texts, [str(s) or None for s in batch["side"]], self.batch_size)
        else:
            emb = inference_embeddings(self.model, texts, self.batch_size, self.side)
        emb = emb.astype(np.float32)
        out = {k: v for k, v in batch.items() if (k != "text" or self.keep_text) and k != "side"}
        out["embedding"] = normalised(emb) if self.normalise else emb
        return out


def ray_encode(model_path: str, sentences: list[str], *, batch_size: int = 64,
               pool: EncoderPool = ONE_ACTOR, side: str | None = None,
               sides: list[str | None] | None = None) -> np.ndarray:
    """Embeddings of ``sentences`` (on ``side``, or each on its own of ``sides``) in input order, computed across
    the Ray cluster in one pass."""
    import ray

    if not sentences:
        return np.zeros((0, 0), dtype=np.float32)
    # rows of one side and similar lengths share a batch
    order = sorted(range(len(sentences)), key=lambda i: (sides[i] or "" if sides else "", len(sentences[i])))
    items = [{"idx": i, "text": sentences[i], **({"side": sides[i] or ""} if sides else {})} for i in order]
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


class Encodings:
    """The embeddings of every text a job scores with one model, by (side, text). A call encodes what it lacks in
    one Ray Data pass (one actor start, one model load: seconds each), together with the texts the job said it
    will ask for later (``expect``): an evaluation's STS sentences and every retrieval task's queries share one
    pass, and every later scoring (Matryoshka sizes, an RSE model's relation scores) reads the table."""

    def __init__(self, model_path: str, batch_size: int, pool: EncoderPool = ONE_ACTOR):
        self.model_path, self.batch_size, self.pool = model_path, batch_size, pool
        self.table: dict[tuple[str | None, str], np.ndarray] = {}
        self.expected: dict[tuple[str | None, str], None] = {}  # an ordered set

    def expect(self, texts, side: str | None = None) -> None:
        """Encode ``texts`` on ``side`` with the next pass."""
        self.expected.update((key, None) for key in ((side, str(t)) for t in texts) if key not in self.table)

    def __call__(self, texts, side: str | None = None) -> np.ndarray:
        keys = [(side, str(t)) for t in texts]
        missing = list(dict.fromkeys([*(k for k in keys if k not in self.table), *self.expected]))
        if missing:
            counts = {s: sum(1 for k in missing if k[0] == s) for s in dict.fromkeys(k[0] for k in missing)}
            what = ", ".join(f"{n} {PLURAL.get(s, s)}" for s, n in counts.items())
            print(f"encoding {what} with {self.pool.actors} actor(s) ...", flush=True)
            sides = [s for s, _ in missing]
            embeddings = ray_encode(self.model_path, [t for _, t in missing], batch_size=self.batch_size,
                                    pool=self.pool, **({"sides": sides} if len(counts) > 1 else {"side": sides[0]}))
            self.table.update(zip(missing, embeddings))
            self.expected.clear()
        return np.stack([self.table[k] for k in keys]) if keys else np.zeros((0, 0), dtype=np.float32)

    def encoder(self, side: str | None = None):
        """``encode(sentences)`` on ``side``, for the STS scorers."""
        return lambda sentences: self(sentences, side)


def score_with_ray(model_path: str, eval_cfg, *, pool: EncoderPool = ONE_ACTOR, predictions: dict | None = None,
                   score=None, encodings: Encodings | None = None, dim: int | None = None) -> dict:
    """The STS suite of ``eval_cfg`` (an EvalConfig) for one model, encoded by a Ray Data actor pool; ``score``
    replaces the cosine (an RSE model's relation score); ``encodings`` shares embeddings between calls (every
    ``dim`` cuts the same ones) and encodes what else the job expects in the same pass; ``dim``: the model's
    leading dimensions only (Matryoshka)."""
    whole = (encodings or Encodings(model_path, eval_cfg.batch_size, pool)).encoder()
    encode = whole if dim is None else (lambda sentences: normalised(whole(sentences), dim))
    return evaluate_sts(encode, eval_cfg.data_dir, eval_cfg.tasks, max_pairs=eval_cfg.max_pairs,
                        stsb_split=eval_cfg.stsb_split, predictions=predictions, score=score)
