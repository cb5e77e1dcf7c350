"""The local head the demo and the submit-latency benchmark use: a real `ray start --head` + `ray job submit`,
and the repeated submission while the head's job agent is not up yet."""

import stat

import ray

from runtime import local_head
from runtime.local_head import AGENT_NOT_READY, LocalHead, head_env


def test_job_runs_on_a_local_head_and_prints_through_submit(tmp_path):
    if ray.is_initialized():  # `ray stop` at the end stops every Ray on this machine, an embedded one too
        ray.shutdown()
    with LocalHead(head_env()) as head:
        assert head.address.startswith("http://127.0.0.1:")
        lines = list(head.submit(["python", "-c", "import os; print('job says', os.environ['RAOE_PROBE'])"],
                                 {"env_vars": {"RAOE_PROBE": "hello"}}, cwd=tmp_path))
    assert head.returncode == 0
    assert any("job says hello" in line for line in lines)


def _fake_ray(folder, script: str):
    ray_cli = folder / "ray"
    ray_cli.write_text("#!/bin/sh\n" + script)
    ray_cli.chmod(ray_cli.stat().st_mode | stat.S_IEXEC)


def test_submission_is_repeated_only_while_the_job_agent_is_not_up(tmp_path, monkeypatch):
    monkeypatch.setattr(local_head, "VENV_BIN", tmp_path)
    monkeypatch.setattr(local_head.time, "sleep", lambda s: None)
    counter = tmp_path / "calls"
    # Fails twice with Ray's "agent not up" answer, then succeeds.
    _fake_ray(tmp_path, f'echo x >> {counter}\nif [ $(wc -l < {counter}) -le 2 ]; then '
                        f'echo "RuntimeError: {AGENT_NOT_READY}, please try again later."; exit 1; fi\necho done\n')
    head = LocalHead(head_env())
    lines = list(head.submit(["python", "job.py"], {}, cwd=tmp_path))
    assert head.returncode == 0 and lines[-1].strip() == "done"
    assert len(counter.read_text().splitlines()) == 3

    # Any other failure is the job's own: reported at once, not repeated.
    counter.unlink()
    _fake_ray(tmp_path, f'echo x >> {counter}\necho "Job failed"; exit 1\n')
    lines = list(head.submit(["python", "job.py"], {}, cwd=tmp_path))
    assert head.returncode == 1 and len(counter.read_text().splitlines()) == 1

    # A head whose agent never comes up: gives up after the configured attempts with the CLI's exit code.
    counter.unlink()
    _fake_ray(tmp_path, f'echo x >> {counter}\necho "{AGENT_NOT_READY}"; exit 1\n')
    list(head.submit(["python", "job.py"], {}, cwd=tmp_path, attempts=3))
    assert head.returncode == 1 and len(counter.read_text().splitlines()) == 3
