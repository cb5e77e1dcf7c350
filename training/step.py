"""One optimizer step on one worker: each micro-batch's rows cut into chunks, each chunk through the encoder with
its own dropout masks, the embeddings gathered into the global batch, the objective, backward.

A chunk's dropout is seeded by its place in the step (``seed_chunk``), never by the worker that encodes it, so the
embeddings of a step, and so the loss and the gradient, are the same on 1 or N workers with dropout on.

Two ways to backpropagate (``trainer.cache_embeddings``):

- **direct**: every chunk's activations are held until one backward of the objective (memory grows with the batch);
- **cached** (GradCache: Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
  Setup"): every chunk is encoded without autograd, the objective and its gradient with respect to each embedding
  (and to any parameter it reads itself, RSE's relation table) are taken on the whole gathered batch, then each chunk
  is encoded again with autograd under the same dropout seed and backpropagates its embeddings' gradient. The loss
  and the gradient equal the direct step's; memory follows the chunk, for one more forward pass.

Every worker runs the same chunks, forward passes, gathers and backward calls in the same order, whatever its rows
hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from objectives.composite import CompositeObjective
from training.kinds import BatchContext, DataKind
from training.kinds.base import Embeddings
from training.plan import StepPlan
from training.rows import CorpusRows, MicroBatchFeed

Rows = dict[str, np.ndarray]


def seed_chunk(seed: int, step: int, chunk: int) -> None:
    """Dropout masks from (seed, step, the chunk's place in the step) alone: the same on any worker count, and a
    resumed run draws the masks an uninterrupted one would, with no RNG state to save (torch.manual_seed also seeds
    every CUDA device). The trailing 0 keeps the masks one-worker runs drew before chunks, seeded then by
    (seed, step, micro-batch, rank 0)."""
    torch.manual_seed(int(np.random.SeedSequence([seed, step, chunk, 0]).generate_state(1)[0]))


def chunk_rows(rows: Rows, chunks: int) -> list[Rows]:
    """A worker's micro-batch rows as ``chunks`` equal, consecutive chunks."""
    size = len(next(iter(rows.values()))) // chunks
    return [{k: v[c * size:(c + 1) * size] for k, v in rows.items()} for c in range(chunks)]


def chunked_calls(kind: DataKind, batches: BatchContext, rows: Rows, chunks: int) -> list:
    """The encode calls of every chunk of a micro-batch, in the order the step makes them (tokenised ahead)."""
    return [call for chunk in chunk_rows(rows, chunks) for call in kind.encode_calls(batches, chunk)]


@dataclass(frozen=True)
class Stepper:
    """What one worker's optimizer step uses; ``__call__`` runs the step's micro-batches and backward passes (the
    optimizer steps in the caller)."""

    plan: StepPlan
    seed: int
    kind: DataKind
    batches: BatchContext
    strategy: Any  # training.strategy.TorchStrategy or DeepSpeedStrategy
    objective: CompositeObjective
    rank: int
    cache_embeddings: bool = False

    def feed(self, rows, prefetch: bool) -> MicroBatchFeed:
        """This worker's micro-batches from ``rows`` (training.rows.CorpusRows or InMemoryRows), each tokenised chunk
        by chunk as this step encodes them (ahead, in a thread, with ``prefetch``)."""
        chunks = self.plan.chunks_per_micro
        draw = self.kind.draw
        return MicroBatchFeed(rows, self.plan, self.seed, self.rank, prefetch=prefetch,
                              prepare=lambda micro: self.batches.tokenized(
                                  chunked_calls(self.kind, self.batches, micro, chunks)),
                              draw=None if draw is None else
                              lambda micro, step, index: draw(self.batches, micro, self.seed, step, index))

    def __call__(self, feed, step: int) -> tuple[float, dict[str, float]]:
        """Every micro-batch of optimizer step ``step``; returns its mean loss and per-objective parts."""
        loss_sum, parts_sum = 0.0, {}
        accum = self.plan.grad_accum
        for micro in range(accum):
            batch = feed.next(step, micro)
            self.batches.tokens.use(batch.prepared)
            run = self._cached if self.cache_embeddings else self._direct
            parts = run(batch.rows, step, micro, last_micro=micro == accum - 1)
            loss_sum += self.objective.total(parts) / accum
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + float(v.detach()) / accum
        return loss_sum, parts_sum

    def _embed(self, rows: Rows, step: int, micro: int, chunk: int) -> Embeddings:
        seed_chunk(self.seed, step, self.plan.chunk_index(micro, self.rank, chunk))
        return self.kind.embed(self.batches, rows)

    def _direct(self, rows: Rows, step: int, micro: int, last_micro: bool):
        """Every chunk's embeddings with autograd, one objective, one backward."""
        chunks = chunk_rows(rows, self.plan.chunks_per_micro)
        with self.strategy.sync_context(last_micro):
            pieces = [self._embed(c, step, micro, k) for k, c in enumerate(chunks)]
            local = {name: torch.cat([p[name] for p in pieces]) for name in pieces[0]}
            share, parts = self.objective(self.kind.assemble(self.batches, rows, local))
            self.strategy.backward(share)
        self.strategy.micro_step()
        return parts

    def _cached(self, rows: Rows, step: int, micro: int, last_micro: bool):
        """GradCache: embeddings without autograd, the objective's gradient with respect to them, then one backward
        per chunk re-encoded under its own seed (one DeepSpeed micro-step each)."""
        chunks = chunk_rows(rows, self.plan.chunks_per_micro)
        with torch.no_grad():
            pieces = [self._embed(c, step, micro, k) for k, c in enumerate(chunks)]
        sizes = {name: [p[name].shape[0] for p in pieces] for name in pieces[0]}
        leaves = {name: torch.cat([p[name] for p in pieces]).requires_grad_() for name in pieces[0]}
        del pieces
        batch = self.kind.assemble(self.batches, rows, leaves)
        share, parts = self.objective(batch)
        direct = batch.trainable()  # parameters the objective reads itself: their gradient goes with the last chunk
        # the gathers' backward adds up the shares; an embedding the objective does not read (triplets' negatives
        # under AnglE's in-batch negatives alone) gets a zero gradient. Whether it is read is decided from the
        # config and the gathered batch, never from a worker's own rows: every worker runs the same gathers' backward
        grads = torch.autograd.grad(share, [*leaves.values(), *direct], allow_unused=True, materialize_grads=True)
        by_chunk = {name: torch.split(g, sizes[name]) for name, g in zip(leaves, grads)}
        direct_grads = grads[len(leaves):]
        for k, chunk in enumerate(chunks):
            last_chunk = k == len(chunks) - 1
            with self.strategy.sync_context(last_micro and last_chunk):
                embeddings = self._embed(chunk, step, micro, k)
                surrogate = sum((embeddings[name] * by_chunk[name][k]).sum() for name in embeddings)
                if last_chunk:
                    surrogate = surrogate + sum((p * g).sum() for p, g in zip(direct, direct_grads))
                self.strategy.backward(surrogate)
            self.strategy.micro_step()
        return parts


class SourceFeeds:
    """The feeds of a mixed-source run's sources, each on its own rows, as the loop uses one feed."""

    def __init__(self, feeds: list[MicroBatchFeed]):
        self.feeds = feeds

    def take_wait(self) -> float:
        return sum(f.take_wait() for f in self.feeds)

    def settle(self) -> None:
        for f in self.feeds:
            f.settle()

    def close(self) -> None:
        for f in self.feeds:
            f.close()


@dataclass(frozen=True)
class SourceSteps:
    """Mixed sources (data.sources): optimizer step k is source ``drawn[k]``'s Stepper at its own step ``local[k]``
    (training.sources): its whole global batch from that source, every worker drawing the same one, so the
    collectives of a step are that source's on every worker."""

    steppers: tuple[Stepper, ...]
    names: tuple[str, ...]
    drawn: np.ndarray
    local: np.ndarray

    @property
    def batches(self) -> BatchContext:  # the model and tokenizer, for evaluation and export
        return self.steppers[0].batches

    def feed(self, rows: list[CorpusRows], prefetch: bool) -> SourceFeeds:
        return SourceFeeds([s.feed(r, prefetch) for s, r in zip(self.steppers, rows)])

    def __call__(self, feed: SourceFeeds, step: int) -> tuple[float, dict[str, float]]:
        source = int(self.drawn[step])
        loss, parts = self.steppers[source](feed.feeds[source], int(self.local[step]))
        return loss, {**parts, f"source_{self.names[source]}": loss}
