"""An RSE model's relation table: one learned vector per relation, a parameter of the training model and two files
beside the exported encoder (``relations.json`` names, ``relations.safetensors`` vectors). Part of the export
format, so ``encoders.backbone`` writes it without depending on the relational scoring code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

RELATIONS_JSON = "relations.json"
RELATIONS_WEIGHTS = "relations.safetensors"
TABLE = "relation_vectors"  # the parameter's name on the training model


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
    model.relation_names = list(names)


def save_relation_table(model: torch.nn.Module, folder: str | Path) -> None:
    from safetensors.numpy import save_file

    vectors = getattr(model, TABLE).detach().float().cpu().numpy()
    folder = Path(folder)
    (folder / RELATIONS_JSON).write_text(json.dumps({"relations": model.relation_names, "dim": vectors.shape[1]},
                                                    indent=2))
    save_file({TABLE: vectors}, str(folder / RELATIONS_WEIGHTS))
