"""Two gloo processes on parts of a batch, each computing its share of the loss (the in-batch losses on its share of
the anchors, tiled), give exactly the one-process loss and gradient."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from objectives import CompositeObjective, EmbeddingBatch, gather_no_grad, gather_with_grad

WEIGHTS = {"rank_margin": 1.0, "gated_angle": 1.0, "angle": 0.5, "angle_ibn": 0.3, "infonce": 0.2}
SPLIT = [13, 19]  # unequal shards: the last batch of an epoch need not divide evenly


def make_problem():
    g = torch.Generator().manual_seed(0)
    n = sum(SPLIT)
    x1, x2 = torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randn(n, 8, generator=g, dtype=torch.float64)
    scores = torch.randint(0, 5, (n,), generator=g).double() / 4
    labels = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(1)
    encoder = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6)).double()
    return encoder, x1, x2, scores, labels


def loss_and_grads(encoder, x1, x2, scores, labels, gather):
    e1, e2 = gather(encoder(x1)), gather(encoder(x2))
    batch = EmbeddingBatch(emb1=e1, emb2=e2, scores=scores, labels=labels)
    objective = CompositeObjective(WEIGHTS, {"rank_margin": {"margin": 1}})
    share, parts = objective(batch)
    share.backward()
    return objective.total(parts), [p.grad.clone() for p in encoder.parameters()]


def worker(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    encoder, x1, x2, scores, labels = make_problem()
    lo, hi = sum(SPLIT[:rank]), sum(SPLIT[: rank + 1])
    scores_all = gather_no_grad(scores[lo:hi], SPLIT)
    labels_all = gather_no_grad(labels[lo:hi], SPLIT)
    loss, grads = loss_and_grads(encoder, x1[lo:hi], x2[lo:hi], scores_all, labels_all,
                                 lambda t: gather_with_grad(t, SPLIT))
    for grad in grads:  # what DDP does: mean of the workers' gradients
        dist.all_reduce(grad)
        grad /= 2
    torch.save({"loss": loss, "grads": grads, "scores": scores_all, "labels": labels_all}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_workers_match_one_worker_exactly(tmp_path):
    encoder, x1, x2, scores, labels = make_problem()
    want_loss, want_grads = loss_and_grads(encoder, x1, x2, scores, labels, lambda t: t)
    mp.start_processes(worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["scores"], scores) and torch.equal(got["labels"], labels)
        assert got["loss"] == pytest.approx(want_loss, rel=1e-12)
        for g, w in zip(got["grads"], want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_gather_is_identity_on_one_process():
    t = torch.randn(3, 2, requires_grad=True)
    assert gather_with_grad(t) is t
