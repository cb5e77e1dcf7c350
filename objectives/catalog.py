"""Every objective's declaration: its hyperparameters with the papers' defaults, the batch fields it reads and the
rows a step must hold; and the named presets. What a config is validated against (jobconfig.schema) and what the
driver checks a job with before it reads its corpus, kept free of torch so neither loads it (nor a job's ``--help``,
nor a Ray Data task that carries a config section). objectives.composite adds what each objective computes;
tests/objectives check these declarations against what it really reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Declaration:
    defaults: dict[str, Any]
    # The batch fields it reads: ``requires`` always; ``accepts`` when the data provides them; of ``either`` the first
    # the data provides (AnglE's in-batch positives: NLI labels, else S).
    requires: tuple[str, ...]
    accepts: tuple[str, ...] = ()
    either: tuple[str, ...] = ()
    # Rows one optimizer step must hold: objectives that rank or contrast the rows of a step (pair ranking, angles,
    # in-batch negatives) are 0 with a gradient of 0 on one row. ListMLE ranks within each list.
    min_rows: int = 2


_PAIR, _IDS = ("emb1", "emb2"), ("ids1", "ids2")
CATALOG: dict[str, Declaration] = {
    "rank_margin": Declaration({"margin": 2.0, "tau": 20.0}, (*_PAIR, "scores")),
    "gated_angle": Declaration({"tau": 20.0}, (*_PAIR, "labels", "scores")),
    "cosent": Declaration({"tau": 20.0}, (*_PAIR, "scores")),
    "angle": Declaration({"tau": 20.0}, (*_PAIR, "scores")),
    "angle_ibn": Declaration({"tau": 20.0, "positive_threshold": 0.8}, _PAIR, accepts=_IDS,
                             either=("labels", "scores")),
    "infonce": Declaration({"tau": 0.05}, _PAIR, accepts=("emb_neg", "neg_mask", *_IDS, "ids_neg")),
    "hince": Declaration({"tau1": 0.05, "tau2": 0.08}, (*_PAIR, "emb_neg"), accepts=("neg_mask",)),
    "listmle": Declaration({"omega": 0.5, "tau": 0.05}, ("list_emb", "list_target"), accepts=("list_mask",),
                           min_rows=1),
    "relational": Declaration({"tau": 0.05}, (*_PAIR, "relation", "relation_table"),
                              accepts=("emb_neg", *_IDS, "ids_neg")),
    # distillation: each query against its own candidates, so one row trains
    "distill_kl": Declaration({"tau": 0.05, "teacher_tau": 1.0}, (*_PAIR, "emb_neg", "teacher_scores"), min_rows=1),
    "margin_mse": Declaration({"similarity": "dot"}, (*_PAIR, "emb_neg", "teacher_scores"), min_rows=1),
}
DEFAULTS: dict[str, dict[str, Any]] = {name: d.defaults for name, d in CATALOG.items()}

# Named recipes from the papers; a config may use one of these instead of spelling out weights.
PRESETS: dict[str, dict[str, float]] = {
    "raoe": {"rank_margin": 1.0, "gated_angle": 1.0},
    "raoe_s2": {"rank_margin": 1.0},
    "angle": {"cosent": 1.0, "angle_ibn": 1.0, "angle": 1.0},
    "cosent": {"cosent": 1.0},
    "simcse": {"infonce": 1.0},
    "hince": {"hince": 1.0},
}


def fields_read(weights: dict[str, float], provided: tuple[str, ...] | set[str]) -> set[str]:
    """The batch fields the composite of ``weights`` reads from data that provides ``provided``, from the
    objectives' declarations; ValueError naming the objective and the missing fields when the data cannot serve it."""
    provided, read = set(provided), set()
    for name in (n for n, w in weights.items() if float(w) != 0.0):
        declared = CATALOG[name]
        missing = [f for f in declared.requires if f not in provided]
        if declared.either and not provided & set(declared.either):
            missing.append(" or ".join(declared.either))
        if missing:
            raise ValueError(f"objective {name!r} needs batch fields {missing}; this data does not provide them")
        picked = [f for f in declared.either if f in provided][:1]
        read |= set(declared.requires) | (set(declared.accepts) & provided) | set(picked)
    return read
