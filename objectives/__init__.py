"""raoe objectives: pure, vectorised PyTorch losses of the five papers (no Ray, no I/O).

Pairwise ranking losses take the cosines of the whole (gathered) batch and return log(1 + sum);
cross-entropy losses return the mean over anchors. See DESIGN.md, "objectives: functional API".
"""

from objectives.angle import angle_composite_loss, angle_ibn_loss, angle_loss, angle_similarity
from objectives.composite import PRESETS, SPECS, CompositeObjective, EmbeddingBatch, objective_params
from objectives.contrastive import hince_loss, infonce_loss
from objectives.gated_angle import gated_angle_loss
from objectives.gather import gather_no_grad, gather_with_grad
from objectives.listwise import listmle_loss, refine_targets
from objectives.rank_margin import cosent_loss, rank_margin_loss
from objectives.relational import relation_scores, relational_loss

__all__ = [
    "rank_margin_loss", "gated_angle_loss", "cosent_loss", "angle_loss", "angle_similarity", "angle_ibn_loss",
    "angle_composite_loss", "infonce_loss", "hince_loss", "listmle_loss", "refine_targets", "relational_loss",
    "relation_scores", "gather_with_grad", "gather_no_grad", "CompositeObjective", "EmbeddingBatch", "SPECS",
    "PRESETS", "objective_params",
]
