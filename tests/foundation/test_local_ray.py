"""A local Ray started by a job listens on loopback only and is shut down when the job ends."""

import os

import psutil
import pytest


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
    assert not ray.is_initialized()
    gone, alive = psutil.wait_procs([p for p in started if p.is_running()], timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
