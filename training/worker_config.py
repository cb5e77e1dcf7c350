"""What a Ray Train worker is handed: one frozen, typed object the driver builds from the validated job config.
Workers read it by attribute; every default lives in the config schema (jobconfig.schema), none here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from jobconfig.schema import ModelConfig, TrainerConfig
from tracking.metrics import RunTarget
from training.plan import StepPlan
from training.rows import CorpusBlocks

STS_DEV_METRIC = "stsb_dev_spearman"
RETRIEVAL_DEV_METRIC = "dev_ndcg_at_10"


@dataclass(frozen=True)
class DevSet:
    """What selects checkpoints: STS-B dev pairs, or a retrieval dev task (eval.dev_retrieval), read once by the
    driver and put in Ray's object store (a worker's node may not hold the files); ``data`` is None when the run has
    no dev set. ``metric`` names the score in step metrics, checkpoints, results and the registry."""

    data: Any  # ray.ObjectRef to evaluation.sts.STSPairs or evaluation.retrieval.RetrievalDevSet, or None
    metric: str  # STS_DEV_METRIC or RETRIEVAL_DEV_METRIC
    label: str  # the score as the progress line names it
    batch_size: int
    relation_weights: dict[str, float] | None  # RSE: the relation-weighted score selects on STS-B dev

    @property
    def retrieval(self) -> bool:
        return self.metric == RETRIEVAL_DEV_METRIC


@dataclass(frozen=True)
class SourceRun:
    """One corpus of a mixed-source run (data.sources), as its steps train it: its kind of data, rows and plan (the
    run's batch shape over its own rows), objective, gathered fields, group size and prompts."""

    name: str
    weight: float
    kind: str
    corpus: CorpusBlocks
    plan: StepPlan
    objective_weights: dict[str, float]
    fields: tuple[str, ...]
    group_size: int = 1
    prompts: dict[str, str] | None = None


@dataclass(frozen=True)
class WorkerConfig:
    model: ModelConfig
    trainer: TrainerConfig
    start_model: str  # resolved by each worker (a driver's local path may not exist on another node)
    objective_weights: dict[str, float]
    objective_params: dict[str, dict[str, Any]]
    plan: StepPlan
    corpus: CorpusBlocks  # the content-ordered training rows in Ray's object store (training.rows)
    prefetch: bool  # data.prefetch: the next micro-batch taken and tokenised in a background thread
    kind: str  # training.kinds.TRAINING_KINDS
    fields: tuple[str, ...]  # corpus columns gathered for the objective (scores, labels): the same on every worker
    dev: DevSet
    run_folder: str  # where Ray Train puts this run's checkpoints
    tracking: RunTarget  # rank 0 logs its step metrics there
    extras: dict[str, Any]  # what the kind's load() gave the workers (RSE: relations, relation lr, init std)
    after_step: tuple[Callable[..., None], ...]  # hooks called after each optimizer step: tests' fault injection
    group_size: int = 1  # query groups: texts per query and step (data.group_size)
    matryoshka: tuple[tuple[int, float], ...] = ()  # objective.matryoshka: (dim, weight), largest first
    sources: tuple[SourceRun, ...] = ()  # data.sources: each step one of them (training.sources); else ``corpus``

    def for_world(self, world: int) -> "WorkerConfig":
        """The same global batches on ``world`` workers (elastic training), every source's too."""
        return replace(self, plan=self.plan.for_world(world),
                       sources=tuple(replace(s, plan=s.plan.for_world(world)) for s in self.sources))
