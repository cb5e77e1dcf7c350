"""All-gather with gradient, so the objective sees the global batch on every worker, and each worker computes its
share of the loss.

Each worker's loss is its share (objectives.composite): the in-batch losses take their anchors' rows only, the
others divide the global value by the world size, so the shares of all workers sum to the loss. The gradient of
the loss with respect to a worker's own embeddings is then the sum over workers of each share's gradient with
respect to them: the backward pass all-reduces the gathered tensor's gradient and returns this worker's slice, times
the world size, so that DDP's (and DeepSpeed's) mean over workers of the parameter gradients equals the one-worker
gradient on the whole batch exactly. A parameter the objective reads directly (RSE's relation table) takes the same
factor (``sum_over_workers``).

Rows are equal on every worker unless ``sizes`` says otherwise (the plan knows them): no size exchange and no host
synchronisation per gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_position() -> tuple[int, int]:
    """(rank, world size) of this process's group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(local: torch.Tensor, sizes: list[int] | None, world: int) -> torch.Tensor:
    longest = local.shape[0] if sizes is None else max(sizes)
    padded = local
    if local.shape[0] != longest:
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat(parts if sizes is None else [p[:n] for p, n in zip(parts, sizes)], dim=0)


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:  # noqa: D102
        rank, world = world_position()
        ctx.start = local.shape[0] * rank if sizes is None else sum(sizes[:rank])
        ctx.count, ctx.world = local.shape[0], world
        return _gather(local, sizes, world)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every worker's share's gradient with respect to these rows
        return grad[ctx.start: ctx.start + ctx.count] * ctx.world, None


class _SumOverWorkers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.world = world_position()[1]
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad * ctx.world


def gather_with_grad(local: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate ``local`` of every worker in rank order (``sizes``: each worker's rows, when they differ);
    identity on one process."""
    if world_position()[1] == 1:
        return local
    return _GatherWithGrad.apply(local, sizes)


def gather_no_grad(local: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Same concatenation for tensors without gradient (scores, labels, text ids)."""
    world = world_position()[1]
    if world == 1:
        return local
    with torch.no_grad():
        if local.dtype == torch.bool:  # gloo cannot all-gather bool
            return _gather(local.to(torch.uint8), sizes, world).bool()
        return _gather(local.detach(), sizes, world)


def sum_over_workers(parameter: torch.Tensor) -> torch.Tensor:
    """``parameter`` as it is, its gradient times the world size in backward: each worker's share gives its part of
    the gradient, and DDP's mean over workers then gives their sum."""
    if world_position()[1] == 1:
        return parameter
    return _SumOverWorkers.apply(parameter)


def summed(values: torch.Tensor) -> torch.Tensor:
    """The sum over workers of a detached tensor (the shares of the loss, for logging)."""
    if world_position()[1] == 1:
        return values
    values = values.detach().clone()
    dist.all_reduce(values)
    return values
