"""Every objective's name, its hyperparameters with the papers' defaults, and its citation, plus the
weighted composite built from config: ``{weights: {name: w}, <name>: {param: value}}``.

A component reads what it needs from an ``EmbeddingBatch`` (the gathered, global batch), so the
training loop builds one batch and the config alone decides what is trained.

On N workers each computes its share of the loss (``CompositeObjective.__call__``): the in-batch losses only their
own share of the anchors, against every candidate, in tiles (``ObjectiveSpec.share``: no worker holds a B x B logit
matrix); the rank and list losses, O(B log B), their global value / N. The gathers' backward adds the shares'
gradients up (objectives.gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from objectives._common import pair_cosine
from objectives.angle import angle_ibn_loss, angle_ibn_share, angle_loss
from objectives.catalog import CATALOG, PRESETS, Declaration, fields_read  # noqa: F401  (PRESETS, fields_read re-exported)
from objectives.contrastive import hince_loss, hince_share, infonce_loss
from objectives.distillation import distill_kl_loss, margin_mse_loss
from objectives.gated_angle import gated_angle_loss
from objectives.gather import sum_over_workers, summed, world_position
from objectives.listwise import listmle_loss, refine_targets
from objectives.rank_margin import cosent_loss, rank_margin_loss
from objectives.references import (
    ANGLE,
    COSENT,
    MARGIN_MSE,
    RANKED_LISTS,
    RAOE,
    ROCKETQA_V2,
    RSE,
    SAN,
    SIMCSE,
    Reference,
)
from objectives.relational import relational_loss, relational_share

ENTAILMENT, NEUTRAL, CONTRADICTION = 0, 1, 2


@dataclass
class EmbeddingBatch:
    """Embeddings and labels of one global batch. Only the fields an objective needs must be set."""

    emb1: torch.Tensor | None = None  # [B, d] first sentences (anchors, heads, list seeds)
    emb2: torch.Tensor | None = None  # [B, d] second sentences (positives, tails)
    emb_neg: torch.Tensor | None = None  # [B', d] hard / syntactically aligned negatives
    neg_mask: torch.Tensor | None = None  # [B'] bool: the aligned negative is real (SAN leaves some anchors without)
    scores: torch.Tensor | None = None  # [B] similarity S in [0, 1]
    labels: torch.Tensor | None = None  # [B] NLI labels E=0, N=1, C=2
    ids1: torch.Tensor | None = None  # [B] integer ids of the first texts (duplicate detection)
    ids2: torch.Tensor | None = None
    ids_neg: torch.Tensor | None = None  # [B'] integer ids of the negatives' texts (RSE false-negative masking)
    relation: torch.Tensor | None = None  # [B] relation index (RSE)
    relation_table: torch.Tensor | None = None  # [K, d] learned relation vectors (RSE)
    list_emb: torch.Tensor | None = None  # [R, n, d] ranked lists, seed first (ListMLE)
    list_mask: torch.Tensor | None = None  # [R, n] real items of padded lists
    list_target: torch.Tensor | None = None  # [R, n, n] teacher similarity of each list's sentences (ListMLE)
    teacher_scores: torch.Tensor | None = None  # [B, 1 + k] a teacher's scores of each query's positive and negatives

    def require(self, objective: str, *names: str) -> list[torch.Tensor]:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"objective {objective!r} needs batch fields {missing}; this data does not provide them")
        return [getattr(self, n) for n in names]

    def trainable(self) -> list[torch.Tensor]:
        """The trainable parameters an objective reads directly rather than through an embedding (RSE's relation
        table): cached embeddings (training.step) take their gradient from the objective itself."""
        return [t for t in (self.relation_table,) if t is not None and t.requires_grad]

    def cosines(self) -> torch.Tensor:
        e1, e2 = self.require("pairwise", "emb1", "emb2")
        return pair_cosine(e1, e2)


@dataclass(frozen=True)
class ObjectiveSpec:
    """What an objective computes; what it reads and its defaults are declared in ``objectives.catalog`` (free of
    torch, for config validation and the driver's checks), and tests/objectives check those declarations against
    what ``compute`` really reads."""

    name: str
    summary: str
    references: tuple[Reference, ...]  # the papers it implements (objectives.references)
    compute: Callable[[EmbeddingBatch, dict[str, Any]], torch.Tensor] = field(repr=False)
    # The in-batch losses: this worker's share, from the anchors ``rows`` of the global batch (batch, params, rows);
    # the shares of workers that split the anchors sum to ``compute``'s value, gradient included
    share: Callable[[EmbeddingBatch, dict[str, Any], slice], torch.Tensor] | None = field(default=None, repr=False)

    @property
    def declared(self) -> Declaration:
        return CATALOG[self.name]

    defaults = property(lambda self: self.declared.defaults)
    requires = property(lambda self: self.declared.requires)
    accepts = property(lambda self: self.declared.accepts)
    either = property(lambda self: self.declared.either)
    min_rows = property(lambda self: self.declared.min_rows)


def _positive_pairs(batch: EmbeddingBatch, threshold: float) -> torch.Tensor:
    """Positives for in-batch negatives: entailment pairs when NLI labels exist, else S >= threshold."""
    if batch.labels is not None:
        return batch.labels == ENTAILMENT
    (scores,) = batch.require("angle_ibn", "scores")
    return scores >= threshold


def _listmle(batch: EmbeddingBatch, p: dict[str, Any]) -> torch.Tensor:
    """Ranking-sentences Eq. 8: for each list, ListMLE of every row j of the student's cosine matrix / tau, ordered by
    the refined targets (Eq. 5-7) of the teacher's (or frozen start model's) similarity matrix; mean over lists."""
    lists, targets = batch.require("listmle", "list_emb", "list_target")
    normed = F.normalize(lists, dim=-1)
    losses = []
    for r in range(normed.shape[0]):  # one list at a time: each has its own n x n matrix
        keep = slice(None) if batch.list_mask is None else batch.list_mask[r]
        sim = normed[r][keep] @ normed[r][keep].T
        phi = targets[r][keep][:, keep]
        losses.append(listmle_loss(sim / p["tau"], refine_targets(phi, p["omega"])))
    return torch.stack(losses).mean()


SPECS: dict[str, ObjectiveSpec] = {
    s.name: s
    for s in [
        ObjectiveSpec(
            "rank_margin", "RAOE Rank Margin, Eq. 2", (RAOE,),
            lambda b, p: rank_margin_loss(b.cosines(), b.require("rank_margin", "scores")[0], **p),
        ),
        ObjectiveSpec(
            "gated_angle", "RAOE Gated Angular, Eq. 3", (RAOE,),
            lambda b, p: gated_angle_loss(b.cosines(), *b.require("gated_angle", "labels", "scores"), **p),
        ),
        ObjectiveSpec(
            "cosent", "CoSENT / AnglE cosine objective, Eq. 1", (COSENT, ANGLE),
            lambda b, p: cosent_loss(b.cosines(), b.require("cosent", "scores")[0], **p),
        ),
        ObjectiveSpec(
            "angle", "AnglE complex-space angle objective, Eq. 4-7", (ANGLE,),
            lambda b, p: angle_loss(*b.require("angle", "emb1", "emb2", "scores"), **p),
        ),
        ObjectiveSpec(
            "angle_ibn", "AnglE in-batch negatives with supervised positives, Eq. 2", (ANGLE,),
            lambda b, p: angle_ibn_loss(
                *b.require("angle_ibn", "emb1", "emb2"), _positive_pairs(b, p["positive_threshold"]),
                tau=p["tau"], ids1=b.ids1, ids2=b.ids2,
            ),
            share=lambda b, p, rows: angle_ibn_share(
                *b.require("angle_ibn", "emb1", "emb2"), _positive_pairs(b, p["positive_threshold"]), rows,
                tau=p["tau"], ids1=b.ids1, ids2=b.ids2,
            ),
        ),
        ObjectiveSpec(
            "infonce", "Supervised SimCSE InfoNCE (hard negatives optional)",
            (SIMCSE,),
            lambda b, p: infonce_loss(*b.require("infonce", "emb1", "emb2"), b.emb_neg, negative_mask=b.neg_mask,
                                      anchor_ids=b.ids1, positive_ids=b.ids2, negative_ids=b.ids_neg, **p),
            share=lambda b, p, rows: hince_share(*b.require("infonce", "emb1", "emb2"), b.emb_neg, rows, tau1=p["tau"],
                                                 tau2=p["tau"], negative_mask=b.neg_mask, anchor_ids=b.ids1,
                                                 positive_ids=b.ids2, negative_ids=b.ids_neg),
        ),
        ObjectiveSpec(
            "hince", "Hierarchical InfoNCE, Eq. 2", (SAN,),
            lambda b, p: hince_loss(*b.require("hince", "emb1", "emb2", "emb_neg"), negative_mask=b.neg_mask, **p),
            share=lambda b, p, rows: hince_share(*b.require("hince", "emb1", "emb2", "emb_neg"), rows,
                                                 negative_mask=b.neg_mask, **p),
        ),
        ObjectiveSpec("listmle", "ListMLE on refined targets, Eq. 5-8", (RANKED_LISTS,),
                      _listmle),
        ObjectiveSpec(
            "relational", "RSE relational contrastive objective, Eq. 1-2",
            (RSE,),
            lambda b, p: relational_loss(
                *b.require("relational", "emb1", "emb2", "relation", "relation_table"), b.emb_neg, b.ids1, b.ids2,
                b.ids_neg, **p
            ),
            share=lambda b, p, rows: relational_share(
                *b.require("relational", "emb1", "emb2", "relation", "relation_table"), b.emb_neg, b.ids1, b.ids2,
                b.ids_neg, rows, **p
            ),
        ),
        ObjectiveSpec(
            "distill_kl", "KL of each query's candidate distribution to a teacher's (listwise distillation)",
            (ROCKETQA_V2,),
            lambda b, p: distill_kl_loss(*b.require("distill_kl", "emb1", "emb2", "emb_neg", "teacher_scores"), **p),
        ),
        ObjectiveSpec(
            "margin_mse", "MarginMSE: the student's positive-negative margins against the teacher's", (MARGIN_MSE,),
            lambda b, p: margin_mse_loss(*b.require("margin_mse", "emb1", "emb2", "emb_neg", "teacher_scores"), **p),
        ),
    ]
}

assert set(SPECS) == set(CATALOG), "objectives.catalog declares every objective composite computes"


def objective_params(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The paper defaults of objective ``name`` with ``overrides`` applied; unknown names/keys are errors."""
    if name not in SPECS:
        raise KeyError(f"unknown objective {name!r}; known: {sorted(SPECS)}")
    params = dict(SPECS[name].defaults)
    for key, value in (overrides or {}).items():
        if key not in params:
            raise KeyError(f"objective {name!r} has no parameter {key!r}; it has {sorted(params)}")
        params[key] = value
    return params


def check_inputs(batch: EmbeddingBatch) -> None:
    """Refuse what the losses would silently mis-rank: a non-finite S (NaN compares false, so the dense and the
    sorted forms disagree) or a label outside E/N/C. Called on the gathered batch, so every worker agrees."""
    if batch.scores is not None and not bool(torch.isfinite(batch.scores).all()):
        bad = int((~torch.isfinite(batch.scores)).sum())
        raise ValueError(f"{bad} of {batch.scores.numel()} similarity scores S in this batch are NaN or infinite; "
                         f"annotate the corpus (ray_jobs/annotate.py) or fix its 'similarity' column")
    if batch.teacher_scores is not None and not bool(torch.isfinite(batch.teacher_scores).all()):
        raise ValueError("teacher scores in this batch are missing or not finite: every query group needs "
                         "positive_scores and negative_scores (ray_jobs/mine_negatives.py or ray_jobs/annotate.py)")
    if batch.labels is not None and not bool(((batch.labels >= 0) & (batch.labels <= CONTRADICTION)).all()):
        raise ValueError(f"NLI labels must be entailment/neutral/contradiction (0/1/2); this batch holds "
                         f"{sorted(set(batch.labels.tolist()))}")


def anchor_rows(batch: int, rank: int, world: int) -> slice:
    """The anchors whose in-batch losses worker ``rank`` computes: its consecutive share of the batch."""
    return slice(batch * rank // world, batch * (rank + 1) // world)


# The embeddings Matryoshka truncates (every [..., d] field of a batch); RSE's relation vectors are cut with them
EMBEDDING_FIELDS = ("emb1", "emb2", "emb_neg", "list_emb")


def truncated(batch: EmbeddingBatch, dim: int) -> EmbeddingBatch:
    """The batch at the first ``dim`` dimensions of every embedding, renormalised (Matryoshka); the relation table
    cut to the same dimensions (a translation, not renormalised)."""
    cut = {}
    for name in EMBEDDING_FIELDS:
        tensor = getattr(batch, name)
        if tensor is not None:
            if dim > tensor.shape[-1]:
                raise ValueError(f"objective.matryoshka.dims: {dim} exceeds the model's {tensor.shape[-1]} "
                                 f"embedding dimensions")
            cut[name] = F.normalize(tensor[..., :dim], dim=-1)
    if batch.relation_table is not None:
        cut["relation_table"] = batch.relation_table[..., :dim]
    return replace(batch, **cut)


class CompositeObjective:
    """sum_k w_k L_k(batch); components with weight 0 are skipped. Returns (this worker's share of the total, for
    backward; {name: value} of the whole batch). On one process the share is the total (``total`` of the parts).

    With ``matryoshka`` ((dim, weight), ...) the composite is taken at each truncated, renormalised dimension and
    summed with those weights; its parts are named ``<objective>_dim<d>``. It reads the gathered embeddings only, so
    cached embeddings, tiled shares and ZeRO need nothing of their own."""

    def __init__(self, weights: dict[str, float], params: dict[str, dict[str, Any]] | None = None,
                 matryoshka: tuple[tuple[int, float], ...] = ()):
        params = params or {}
        self.weights = {n: float(w) for n, w in weights.items() if float(w) != 0.0}
        if not self.weights:
            raise ValueError("the composite objective needs at least one component with a non-zero weight")
        self.params = {n: objective_params(n, params.get(n)) for n in self.weights}
        self.dims = tuple((int(d), float(w)) for d, w in matryoshka if float(w) != 0.0)
        # part name -> (objective, dimension or None for the whole embedding, weight in the total)
        self.part_of = {n: (n, None, w) for n, w in self.weights.items()} if not self.dims else {
            f"{n}_dim{d}": (n, d, w * dw) for d, dw in self.dims for n, w in self.weights.items()}

    def __call__(self, batch: EmbeddingBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        check_inputs(batch)
        rank, world = world_position()
        if batch.relation_table is not None:  # read on every worker: its gradient summed, not averaged, over them
            batch = replace(batch, relation_table=sum_over_workers(batch.relation_table))
        anchors = next((len(t) for t in (batch.emb1, batch.list_emb) if t is not None), 0)
        rows = anchor_rows(anchors, rank, world)
        at = {d: batch if d is None else truncated(batch, d) for _, d, _ in self.part_of.values()}
        shares = {}
        for part, (n, d, _) in self.part_of.items():
            spec = SPECS[n]
            shares[part] = spec.share(at[d], self.params[n], rows) if spec.share is not None \
                else spec.compute(at[d], self.params[n]) / world
        share = sum(self.part_of[p][2] * shares[p] for p in shares)
        parts = dict(zip(shares, summed(torch.stack([v.detach() for v in shares.values()]))))  # one all-reduce
        return share, parts

    def total(self, parts: dict[str, torch.Tensor]) -> float:
        """The weighted loss of the whole batch from its parts."""
        return float(sum(self.part_of[p][2] * float(parts[p]) for p in parts))

    def parts(self, batch: EmbeddingBatch) -> dict[str, torch.Tensor]:
        """Each component's unweighted value (no input checks: the driver probes which fields they read)."""
        return {n: SPECS[n].compute(batch, self.params[n]) for n in self.weights}

    def describe(self) -> dict[str, Any]:
        """What is trained, for run params and model cards."""
        return {
            n: {"weight": w, "params": self.params[n], "citation": "; ".join(r.short() for r in SPECS[n].references),
                "bibtex": [r.bibtex() for r in SPECS[n].references], "summary": SPECS[n].summary}
            for n, w in self.weights.items()
        }
