"""What every kind of training data shares: the table entry (``DataKind``), the contract of its two phases (``embed``:
``BatchContext`` and a chunk of rows in, the chunk's embeddings out; ``assemble``: a worker's rows and their
embeddings in, an ``EmbeddingBatch`` of the gathered global batch out), the trainable state a kind may add to the
model (``ModelAdditions``), and the helpers the phases encode and gather with.

Every worker gathers the same fields in the same order, decided by the driver from the config, whatever its own
rows hold (else the all-gathers misalign or hang)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import numpy as np
import torch

from encoders.backbone import (
    TokenCache,
    dropout_settings,
    dropout_settings_applied,
    forward_in_length_buckets,
    side_encoding,
    text_ids,
)
from objectives.gather import gather_no_grad
from training.kinds.kind import FIELD_COLUMNS

# One ``BatchContext.encode`` call a kind makes on a chunk: (texts, buckets or None for length_buckets, side)
EncodeCall = tuple[list[str], int | None, str | None]


@dataclass(frozen=True)
class BatchContext:
    """What a batch builder may use, the same on every worker of a run."""

    module: torch.nn.Module  # runs the forward: the model, or its DDP / DeepSpeed wrapper
    model: torch.nn.Module  # the bare SentenceTransformer: tokenizer, dropout modules, trainable additions
    device: torch.device
    autocast: Callable[[], ContextManager] | None = None  # the strategy's autocast around the encoder, or none
    length_buckets: int = 1  # trainer.length_buckets
    fields: tuple[str, ...] = ()  # corpus columns the objective reads (FIELD_COLUMNS keys): gathered if listed
    negative_dropout: float | None = None  # model.negative_dropout: SAN's p2 for the aligned negatives
    tokens: TokenCache = field(default_factory=TokenCache)  # the micro-batch's inputs, tokenised ahead
    sides: dict[str, str] = field(default_factory=dict)  # text column -> 'query' | 'document' (DataKind.sides)
    group_size: int = 1  # data.group_size: query groups' texts per query and step (1 positive, the rest negatives)
    prompts: dict[str, str] | None = None  # a data source's own query/document prompts (data.sources[].prompts)

    def encode(self, texts: list[str], buckets: int | None = None, side: str | None = None) -> torch.Tensor:
        """Embeddings with gradient of texts on ``side`` (its prompt and max length), in ``buckets`` (default
        ``length_buckets``) length-grouped forward passes. Each forward pass is a collective (DDP broadcasts
        buffers, ZeRO-3 gathers weights), so every worker must run as many: a caller whose text count differs
        between workers (ranked lists) passes ``buckets`` chosen from a count every worker holds."""
        with self.autocast() if self.autocast else contextlib.nullcontext():
            return forward_in_length_buckets(self.module, self.model, texts, self.device,
                                             self.length_buckets if buckets is None else buckets, self.tokens,
                                             side, self.prompts).float()

    def tokenized(self, calls: list[EncodeCall]) -> dict:
        """The tokenised inputs of ``encode`` calls, prepared off the training thread."""
        return self.tokens.prepare(self.model, [(texts, self.length_buckets if buckets is None else buckets, side)
                                                for texts, buckets, side in calls], pin=self.device.type == "cuda",
                                   prompts=self.prompts)

    def side_groups(self, columns: dict[str, list[str]]) -> list[tuple[str | None, list[str]]]:
        """(side, column names) of each encode call over the texts of ``columns``: columns that encode alike (the
        same prompt and max length: with no model.prompts and lengths, all of them) share one call. Decided by the
        config alone, so every worker makes the same calls."""
        groups: dict[tuple, tuple[str | None, list[str]]] = {}
        for name in columns:
            side = self.sides.get(name)
            groups.setdefault(side_encoding(self.model, side, self.prompts), (side, []))[1].append(name)
        return list(groups.values())

    def column_calls(self, columns: dict[str, list[str]]) -> list[EncodeCall]:
        """The encode calls ``encode_columns`` makes."""
        return [([t for name in names for t in columns[name]], None, side) for side, names in self.side_groups(columns)]

    def encode_columns(self, columns: dict[str, list[str]]) -> dict[str, torch.Tensor]:
        """Each column's embeddings, its texts encoded on its side (``sides``), columns alike in one call."""
        out = {}
        for side, names in self.side_groups(columns):
            every = self.encode([t for name in names for t in columns[name]], side=side)
            out.update(zip(names, every.split([len(columns[name]) for name in names])))
        return out

    def gather_fields(self, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The listed ``fields``: scores (None -> NaN, which the objective refuses by name), labels (None -> -1,
        likewise) and query groups' teacher scores (positive first), gathered."""
        out = {}
        if "scores" in self.fields:
            column = rows[FIELD_COLUMNS["scores"]]
            scores = np.array([np.nan if v is None else v for v in column], dtype=np.float32)
            out["scores"] = gather_no_grad(torch.from_numpy(scores).to(self.device))
        if "labels" in self.fields:
            labels = np.array([-1 if v is None else v for v in rows[FIELD_COLUMNS["labels"]]], dtype=np.int64)
            out["labels"] = gather_no_grad(torch.from_numpy(labels).to(self.device))
        if "teacher_scores" in self.fields:  # [rows, group_size]: a group without scores is NaN, refused by name
            width = self.group_size
            teacher = np.array([[np.nan] * width if v is None else v for v in rows[FIELD_COLUMNS["teacher_scores"]]],
                               dtype=np.float32).reshape(-1, width)
            out["teacher_scores"] = gather_no_grad(torch.from_numpy(teacher).to(self.device))
        return out

    def gather_ids(self, texts: list[str]) -> torch.Tensor:
        """Stable ids of the texts, gathered: objectives recognise duplicates across workers by them."""
        return gather_no_grad(text_ids(texts).to(self.device))


@dataclass(frozen=True)
class ModelAdditions:
    """Trainable state a kind adds beside the encoder (RSE's relation table), as the strategy takes it: parameter
    groups of their own for the optimizer, and parameters whose gradient norm is logged by name."""

    param_groups: tuple[dict, ...] = ()  # torch optimizer groups: {"params": [...], "lr": ..., "weight_decay": ...}
    watched: dict[str, torch.nn.Parameter] = field(default_factory=dict)


# A chunk's embeddings by name: tensors whose rows follow the chunk's rows in order (a ranked list's sentences flat,
# list after list), so the chunks of a worker's micro-batch concatenate into the embeddings of its rows.
Embeddings = dict[str, torch.Tensor]


@contextlib.contextmanager
def dropout_rate(model: torch.nn.Module, p: float | None):
    """Every dropout of the encoder at rate ``p`` inside the block (SAN's p2 for aligned negatives), restored after.
    Under gradient checkpointing the backward recomputes these layers at the same rate (encoders.backbone's
    DropoutReplay)."""
    if p is None:
        yield
        return
    with dropout_settings_applied([(module, name, p) for module, name, _ in dropout_settings(model)]):
        yield
