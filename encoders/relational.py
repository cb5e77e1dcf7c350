"""RSE models: a sentence encoder plus one learned vector per relation (h_head + r_k ~ h_tail).

The relation names and vectors live inside the exported sentence-transformers folder (``relations.json`` and
``relations.safetensors``), which ``SentenceTransformer(path)`` still loads for plain embeddings, while
``RelationalEncoder(path)`` scores sentence pairs under a relation or a weighted mix of them:

    m = RelationalEncoder("outputs/models/<run>/model")
    m.score(["a man plays"], ["someone plays music"], relation="entailment")   # cos(h_a + r, h_b)
    m.score(a, b, weights={"entailment": 1.0, "duplicate_question": 0.5})      # weights normalised to sum 1
    m.score(a, b, weights=..., both_directions=True)                          # max of (a, b) and (b, a): STS
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoders.backbone import inference_embeddings, load_encoder, with_relations
from encoders.model_uris import resolve_model
from encoders.relation_table import RELATIONS_JSON, TABLE, read_relation_table


def attach_relation_table(model: torch.nn.Module, names: list[str], start_folder: str | Path | None, *,
                          init_std: float, seed: int) -> None:
    """Give the training model its relation table, a [K, d] parameter registered on the model (so DDP and
    DeepSpeed all-reduce, shard and checkpoint it with the encoder) and used by the loss outside the forward.
    Vectors of relations the start folder already holds are loaded (a resumed run, or a trained RSE start model);
    the others start as N(0, init_std^2) from ``seed``."""
    dim = model.get_embedding_dimension()
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(len(names), dim, generator=generator) * init_std
    saved = read_relation_table(start_folder) if start_folder else None
    if saved is not None:
        for k, name in enumerate(saved[0]):
            if name in names:
                table[names.index(name)] = torch.from_numpy(saved[1][k].copy())
    device = next(model.parameters()).device
    model.register_parameter(TABLE, torch.nn.Parameter(table.to(device)))
    with_relations(model, names)


def normalised_weights(names: list[str], weights: dict[str, float] | None) -> np.ndarray:
    """A weight per relation in table order, summing to 1 (None: equal weights); unknown names are errors."""
    if not weights:
        return np.full(len(names), 1.0 / len(names))
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"unknown relation(s) {unknown}; this model has {names}")
    w = np.array([float(weights.get(n, 0.0)) for n in names])
    if w.sum() <= 0:
        raise ValueError(f"relation weights {weights} must sum to more than 0")
    return w / w.sum()


def relation_pair_scores(emb_a: np.ndarray, emb_b: np.ndarray, vectors: np.ndarray, weights: np.ndarray,
                         both_directions: bool = False) -> np.ndarray:
    """sum_k w_k cos(a_i + r_k, b_i) for each pair i; with ``both_directions`` the max of that and the same
    with a and b swapped."""
    def one_way(a, b):
        queries = a[:, None, :] + vectors[None, :, :]  # [n, K, d]
        queries = queries / np.linalg.norm(queries, axis=-1, keepdims=True).clip(min=1e-12)
        b = b / np.linalg.norm(b, axis=-1, keepdims=True).clip(min=1e-12)
        return np.einsum("nkd,nd->nk", queries, b) @ weights

    a, b = np.asarray(emb_a, dtype=np.float64), np.asarray(emb_b, dtype=np.float64)
    vectors = np.asarray(vectors, dtype=np.float64)
    forward = one_way(a, b)
    return np.maximum(forward, one_way(b, a)) if both_directions else forward


def relation_prediction(encode, triples: list[dict[str, Any]], names: list[str], vectors: np.ndarray,
                        ks: tuple[int, ...] = (1, 3, 10)) -> dict[str, dict[str, float]]:
    """In-domain relation prediction (RSE Appendix B, the link-prediction protocol): for each held-out triple
    (h, r, t), every distinct tail of the held-out slice is a candidate, scored cos(h + r, t'); the rank of t among
    them, with the other true tails of (h, r) filtered out. MRR and Hits@k per relation and over all triples."""
    tails = sorted({t["tail"] for t in triples})
    heads = sorted({t["head"] for t in triples})
    texts = sorted(set(tails) | set(heads))
    index = {s: i for i, s in enumerate(texts)}
    emb = np.asarray(encode(texts), dtype=np.float64)
    tail_emb = emb[[index[t] for t in tails]]
    tail_emb /= np.linalg.norm(tail_emb, axis=1, keepdims=True).clip(min=1e-12)
    tail_index = {t: i for i, t in enumerate(tails)}
    known: dict[tuple[str, str], set[int]] = {}
    for t in triples:
        known.setdefault((t["head"], t["relation"]), set()).add(tail_index[t["tail"]])
    ranks: dict[str, list[int]] = {}
    for t in triples:
        query = emb[index[t["head"]]] + vectors[names.index(t["relation"])]
        scores = tail_emb @ (query / max(np.linalg.norm(query), 1e-12))
        target = tail_index[t["tail"]]
        others = [j for j in known[(t["head"], t["relation"])] if j != target]
        scores[others] = -np.inf  # filtered setting: other true tails are not errors
        ranks.setdefault(t["relation"], []).append(int((scores > scores[target]).sum()) + 1)
    ranks["all"] = [r for rel in list(ranks) for r in ranks[rel]]

    def summary(values: list[int]) -> dict[str, float]:
        arr = np.asarray(values, dtype=np.float64)
        return {"triples": len(values), "candidates": len(tails), "mrr": float(np.mean(1.0 / arr)),
                **{f"hits@{k}": float(np.mean(arr <= k)) for k in ks}}

    return {rel: summary(values) for rel, values in ranks.items()}


def plot_relation_similarity(names: list[str], vectors: np.ndarray, path: str | Path) -> Path:
    """Cosine similarity between the relation vectors (the paper's Figure 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = np.asarray(vectors, dtype=np.float64)
    v = v / np.linalg.norm(v, axis=1, keepdims=True).clip(min=1e-12)
    sim = v @ v.T
    size = 1.2 + 0.7 * len(names)
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    image = ax.imshow(sim, vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), names)
    for i in range(len(names)):
        for j in range(len(names)):
            ax.text(j, i, f"{sim[i, j]:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if abs(sim[i, j]) > 0.5 else "black")
    fig.colorbar(image, ax=ax, label="cosine")
    ax.set_title("relation vectors")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class RelationalEncoder:
    """Load an RSE model folder (or an MLflow model URI) and score sentence pairs under its relations."""

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 64):
        folder = resolve_model(str(path))
        saved = read_relation_table(folder)
        if saved is None:
            raise ValueError(f"{path} holds no relation table ({RELATIONS_JSON}); it is not an RSE model")
        self.names, self.vectors = saved
        self.model = load_encoder(folder, device=device)
        self.batch_size = batch_size

    @property
    def relations(self) -> dict[str, np.ndarray]:
        return {name: self.vectors[k] for k, name in enumerate(self.names)}

    def encode(self, sentences: list[str]) -> np.ndarray:
        return inference_embeddings(self.model, list(sentences), self.batch_size)

    def score(self, a: list[str], b: list[str], relation: str | None = None,
              weights: dict[str, float] | None = None, both_directions: bool = False) -> np.ndarray:
        """cos(h_a + r, h_b) per pair under ``relation``, or the weighted sum over ``weights`` (normalised to sum
        1; neither given: equal weights); ``both_directions`` takes the max with (b, a), as STS scoring does."""
        if relation is not None and weights is not None:
            raise ValueError("give relation or weights, not both")
        if len(a) != len(b):
            raise ValueError(f"{len(a)} first sentences but {len(b)} second ones")
        w = normalised_weights(self.names, {relation: 1.0} if relation is not None else weights)
        return relation_pair_scores(self.encode(a), self.encode(b), self.vectors, w, both_directions)
