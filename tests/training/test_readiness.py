"""The readiness barrier: a worker that is slow to set up is named by rank and node within trainer.ready_timeout_s,
instead of surfacing as the backend's own timeout on the other workers. Three gloo processes, no Ray."""

import os
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from training.readiness import Readiness


def _worker(rank: int, world: int, init: str, delays: list[float], timeout_s: float, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ready = Readiness(rank, world, timeout_s)
    time.sleep(delays[rank])  # the set-up (model, corpus rows)
    try:
        took = ready.wait("loading the model and mapping the corpus rows")
        results.put((rank, f"ok {took:.2f}"))
    except RuntimeError as exc:
        results.put((rank, str(exc)))
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown: the group is broken on purpose in one test


def _run(delays: list[float], timeout_s: float) -> dict[int, str]:
    context = mp.get_context("spawn")
    results = context.Queue()
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    workers = [context.Process(target=_worker, args=(r, len(delays), init, delays, timeout_s, results))
               for r in range(len(delays))]
    for w in workers:
        w.start()
    got = dict(results.get(timeout=60) for _ in workers)
    for w in workers:
        w.join(timeout=30)
    return got


def test_a_slow_worker_is_named_by_rank_and_node_after_the_timeout():
    started = time.perf_counter()
    got = _run([0.0, 6.0, 0.0], timeout_s=1.5)
    assert time.perf_counter() - started < 30  # the timeout, not the backend's 30 minutes
    assert got[0].startswith(f"rank 1 on {os.uname().nodename} not ready 1.5 s after rank 0"), got[0]
    assert "trainer.ready_timeout_s" in got[0]
    assert got[2].startswith("rank 2 left the readiness barrier")  # the others end too, pointing at rank 0


def test_workers_that_arrive_within_the_timeout_pass_and_report_their_own_set_up_time():
    got = _run([0.0, 0.8], timeout_s=20)
    assert set(got) == {0, 1} and all(v.startswith("ok") for v in got.values()), got
    assert float(got[1].split()[1]) >= 0.8 > float(got[0].split()[1])
