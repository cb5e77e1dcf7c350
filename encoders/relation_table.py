"""An RSE model's relation table: one learned vector per relation, a parameter of the training model and two files
beside the exported encoder (``relations.json`` names, ``relations.safetensors`` vectors). Part of the export
format, so ``encoders.backbone`` writes it without depending on the relational scoring code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from encoders.model_files import RELATIONS_JSON, RELATIONS_WEIGHTS, TABLE  # noqa: F401  (re-exported)


def read_relation_table(folder: str | Path) -> tuple[list[str], np.ndarray] | None:
    """(names, [K, d] vectors) saved in a model folder, or None when it holds no relations."""
    folder = Path(folder)
    if not (folder / RELATIONS_JSON).exists():
        return None
    from safetensors.numpy import load_file

    names = json.loads((folder / RELATIONS_JSON).read_text())["relations"]
    vectors = load_file(str(folder / RELATIONS_WEIGHTS))[TABLE]
    if vectors.shape[0] != len(names):
        raise ValueError(f"{folder}: {len(names)} relation names but {vectors.shape[0]} vectors")
    return names, vectors


def save_relation_table(model: torch.nn.Module, names: tuple[str, ...] | list[str], folder: str | Path) -> None:
    from safetensors.numpy import save_file

    vectors = model.get_parameter(TABLE).detach().float().cpu().numpy()
    folder = Path(folder)
    (folder / RELATIONS_JSON).write_text(json.dumps({"relations": list(names), "dim": vectors.shape[1]},
                                                    indent=2))
    save_file({TABLE: vectors}, str(folder / RELATIONS_WEIGHTS))
