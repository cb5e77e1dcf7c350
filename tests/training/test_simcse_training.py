"""SimCSE triplets in the training loop: the hard negatives reach the objective as emb_neg, and configs that
cannot work are refused before Ray starts."""

import numpy as np
import pytest
import torch

from encoders.backbone import build_encoder, forward_pass
from encoders.sources import resolve_model_source
from objectives import infonce_loss
from objectives.composite import CompositeObjective
from tests.training.conftest import tiny_config
from training.kinds import TRAINING_KINDS, BatchContext

PAIRS = TRAINING_KINDS["pairs"]  # its build(): a micro-batch as one chunk

BATCH = {"text1": np.array(["a man plays.", "kids eat.", "dogs run."], dtype=object),
         "text2": np.array(["a human plays.", "children eat.", "animals run."], dtype=object),
         "text_neg": np.array(["a man cries.", "kids starve.", "dogs sleep."], dtype=object),
         "label": np.array([0, 0, 0]), "similarity": np.array([0.9, 0.8, 0.7])}

FIELDS = ("scores", "labels")  # gathered from the rows beside the embeddings


def test_triplet_batch_gives_infonce_its_hard_negatives():
    model = build_encoder(resolve_model_source("tiny:bert"), pooling="mean", dropout=0.0)
    model.eval()
    objective = CompositeObjective({"infonce": 1.0}, {"infonce": {"tau": 0.05}})
    with torch.no_grad():
        loss, _ = objective(PAIRS.build(BatchContext(model, model, torch.device("cpu"), fields=FIELDS), BATCH))
        e1, e2, neg = (forward_pass(model, model, list(BATCH[k])) for k in ("text1", "text2", "text_neg"))
    assert torch.allclose(loss, infonce_loss(e1, e2, neg, tau=0.05), atol=1e-5)
    assert not torch.allclose(loss, infonce_loss(e1, e2, tau=0.05), atol=1e-3)  # the negatives count


def test_hince_without_triplets_is_refused_before_ray(tmp_path):
    from training.run import run_training

    cfg = tiny_config(tmp_path, "no-triplets", "objective.weights={hince: 1.0}")
    with pytest.raises(ValueError, match="emb_neg"):
        run_training(cfg)


def test_triplets_need_nli_pairs(tmp_path):
    from training.run import run_training

    cfg = tiny_config(tmp_path, "stage2-triplets", "data.triplets=true", stage="stage2")
    with pytest.raises(ValueError, match="data.triplets"):
        run_training(cfg)


def test_tiny_simcse_job_trains_on_triplets(simcse_retrieval_dev_run):
    """The run is shared with test_dev_selection (conftest.py): InfoNCE on triplets, 3 steps of 16."""
    result, _ = simcse_retrieval_dev_run
    assert result["metrics"]["steps"] == 3 and np.isfinite(result["metrics"]["train_loss"])
