"""All-gather with gradient, so pairwise objectives see the global batch on every worker.

Every worker computes the same loss on the same gathered tensor, so the gradient of the gathered
tensor is the same everywhere; the backward pass therefore needs no communication: it returns this
worker's slice, times the world size, so that DDP's (and DeepSpeed's) mean over workers of the
parameter gradients equals the one-worker gradient on the whole batch exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:  # noqa: D102
        rank, world = _world()
        size = torch.tensor([local.shape[0]], device=local.device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size)
        sizes = [int(s.item()) for s in sizes]
        longest = max(sizes)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous())
        ctx.start = sum(sizes[:rank])
        ctx.count = local.shape[0]
        ctx.world = world
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad[ctx.start : ctx.start + ctx.count] * ctx.world


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """Concatenate ``local`` of every worker in rank order (rows may differ in number); identity on one process."""
    _, world = _world()
    if world == 1:
        return local
    return _GatherWithGrad.apply(local)


def gather_no_grad(local: torch.Tensor) -> torch.Tensor:
    """Same concatenation for tensors without gradient (scores, labels, text ids)."""
    _, world = _world()
    if world == 1:
        return local
    with torch.no_grad():
        if local.dtype == torch.bool:  # gloo cannot all-gather bool
            return _GatherWithGrad.apply(local.to(torch.uint8)).bool()
        return _GatherWithGrad.apply(local.detach())
