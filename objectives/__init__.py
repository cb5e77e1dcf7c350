"""raoe objectives: pure, vectorised PyTorch losses of the five papers (no Ray, no I/O).

Pairwise ranking losses take the cosines of the whole (gathered) batch and return log(1 + sum);
cross-entropy losses return the mean over anchors. See DESIGN.md, "objectives: functional API".

Names are imported on first use (PEP 562), so ``objectives.catalog`` (names, defaults, presets) loads without torch.
"""

import importlib

_HOMES = {
    "angle_composite_loss": "angle", "angle_ibn_loss": "angle", "angle_loss": "angle", "angle_similarity": "angle",
    "PRESETS": "catalog", "SPECS": "composite", "CompositeObjective": "composite", "EmbeddingBatch": "composite",
    "objective_params": "composite", "hince_loss": "contrastive", "infonce_loss": "contrastive",
    "gated_angle_loss": "gated_angle", "gather_no_grad": "gather", "gather_with_grad": "gather",
    "distill_kl_loss": "distillation", "margin_mse_loss": "distillation",
    "listmle_loss": "listwise", "refine_targets": "listwise", "cosent_loss": "rank_margin",
    "rank_margin_loss": "rank_margin", "relation_scores": "relational", "relational_loss": "relational",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'objectives' has no attribute {name!r}")
    return getattr(importlib.import_module(f"objectives.{_HOMES[name]}"), name)
