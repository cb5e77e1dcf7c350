"""A local Ray started by a job listens on loopback only, keeps its idle task workers warm, and is shut down when the
job ends."""

import os
import time

import psutil
import pytest

pytestmark = pytest.mark.own_ray  # starts and stops a Ray of its own


def listening_addresses(processes):
    found = []
    for proc in processes:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((proc.name(), conn.laddr.ip))
        except psutil.Error:
            continue
    return found


@pytest.mark.skipif(bool(os.environ.get("RAY_ADDRESS")), reason="RAY_ADDRESS points at an existing cluster")
def test_local_ray_binds_to_loopback_and_stops(monkeypatch):
    import ray

    monkeypatch.setenv("RAOE_RAY_DASHBOARD", "1")  # as users run it: the dashboard listens on loopback too

    from runtime.local_ray import ray_session

    if ray.is_initialized():  # another test module's Ray: this test needs one it starts itself
        ray.shutdown()
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # e.g. multiprocessing's resource tracker of another test
    with ray_session(num_cpus=1):
        assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        addresses = listening_addresses(started)
        assert addresses, "Ray should have started listening processes"
        loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
        assert all(ip in loopback for _, ip in addresses), addresses
        assert_idle_task_workers_stay_warm()
    assert not ray.is_initialized()
    gone, alive = psutil.wait_procs([p for p in started if p.is_running()], timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def assert_idle_task_workers_stay_warm():
    """Ray Data runs more tasks at once than the node has CPUs (fractional CPUs), and Ray kills the task workers
    beyond one per CPU after 1 s idle: the next Ray Data task paid a fresh Python (1-2.5 s here). The local Ray
    keeps them."""
    import ray

    @ray.remote(num_cpus=0)
    class Arrivals:
        def __init__(self):
            self.count = 0

        def arrive(self) -> int:
            self.count += 1
            return self.count

        def all_here(self, n: int) -> bool:
            return self.count >= n

    @ray.remote(num_cpus=0.3)
    def pid_once_all_run(arrivals, n):
        ray.get(arrivals.arrive.remote())
        while not ray.get(arrivals.all_here.remote(n)):
            time.sleep(0.05)
        return os.getpid()

    def three_at_once():
        arrivals = Arrivals.remote()
        return set(ray.get([pid_once_all_run.remote(arrivals, 3) for _ in range(3)]))

    first = three_at_once()
    assert len(first) == 3
    time.sleep(2.5)  # Ray's own threshold is 1 s, checked every 0.2 s
    assert three_at_once() == first
