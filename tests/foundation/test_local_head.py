"""The local head the demo and the submit-latency benchmark use: a real `ray start --head` + `ray job submit`,
and the repeated submission while the head's job agent is not up yet."""

import os
import stat
import subprocess

import psutil
import pytest
import ray

from runtime import local_head
from runtime.local_head import AGENT_NOT_READY, LocalHead, head_env

pytestmark = pytest.mark.own_ray  # a head of its own, with the machine's CPUs, in place of the shared Ray


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


def test_a_head_that_fails_to_start_is_reported_with_its_last_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(local_head, "VENV_BIN", tmp_path)
    _fake_ray(tmp_path, 'echo "starting"\necho "ValueError: Resource quantities must be nonnegative"\nexit 3\n')
    with pytest.raises(RuntimeError, match="exited with 3:\nstarting\nValueError: Resource quantities must be"):
        with LocalHead(head_env()):
            pass


def test_the_heads_servers_are_given_distinct_ports(tmp_path, monkeypatch):
    """Its GCS, dashboard, dashboard agent and Ray client ports, taken together (one at a time, two could be the same
    port, and `ray start` refuses that: a reliability run met it)."""
    monkeypatch.setattr(local_head, "VENV_BIN", tmp_path)
    _fake_ray(tmp_path, f'echo "$@" > {tmp_path / "args"}\nexit 3\n')
    for _ in range(20):
        with pytest.raises(RuntimeError, match="exited with 3"):
            with LocalHead(head_env()):
                pass
        args = (tmp_path / "args").read_text().split()
        flags = ("--port", "--dashboard-port", "--dashboard-agent-listen-port", "--ray-client-server-port")
        ports = [int(args[args.index(flag) + 1]) for flag in flags]
        assert len(set(ports)) == 4 and min(ports) > 0, ports


def test_the_head_goes_with_its_process_group_and_nothing_else(tmp_path, monkeypatch):
    """The head runs in a process group of its own and is stopped by a signal: what it started goes with it, a
    process that ignores SIGTERM too (killed with the group), and a process outside the group stays."""
    monkeypatch.setattr(local_head, "VENV_BIN", tmp_path)
    pid_file = tmp_path / "child.pid"
    outsider = subprocess.Popen(["sleep", "300"])
    _fake_ray(tmp_path, f'(trap "" TERM; sleep 300) &\necho $! > {pid_file}\necho "Ray runtime started."\nsleep 300\n')
    try:
        with LocalHead(head_env()) as head:
            child = psutil.Process(int(pid_file.read_text()))
            assert child.is_running() and os.getpgid(child.pid) == head._head.pid
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert head._head.returncode is not None and outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait()


def test_a_submitted_job_registers_a_model_that_outlives_the_cluster(tmp_path, monkeypatch, s3):
    """As the README's first commands run it: `ray job submit --working-dir .` with only an absolute sqlite store
    set. The job runs in Ray's scratch copy of the repository; its outputs, checkpoints and the registered model's
    artifacts must land outside it (RAOE_HOME), so the model still loads after the head is stopped. The job's output reaches
    the submitter (its JSON line) and so does its runtime env (the store it wrote is the one given there). Its
    corpus is on object storage (the local S3 endpoint the head's nodes reach through the AWS variables).
    About 100 s on 2 cores beside another test: a head of its own starts, the job uploads the repository, imports
    the stack in its own process and trains in a Ray Train worker group; the one test of a job run the user's way."""
    import json
    from pathlib import Path

    import mlflow

    if ray.is_initialized():  # the head gets the machine's CPUs to itself
        ray.shutdown()
    root = Path(__file__).resolve().parents[2]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    secrets = {"HF_TOKEN": "hf_SENTINELa1b2c3", "AWS_SECRET_ACCESS_KEY": "SENTINELaws4d5e6",
               "MLFLOW_TRACKING_PASSWORD": "SENTINELpw7f8g9"}
    env = {"MLFLOW_TRACKING_URI": store, "RAOE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", **secrets}
    clean = head_env()  # only what the job is given: no store or artifact root inherited from this process
    for key in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS", "RAOE_HOME"):
        clean.pop(key, None)
    corpus = s3.upload(root / "configs" / "tiny" / "data" / "nli_pairs.jsonl", "nli/train.jsonl")
    with LocalHead(clean) as head:
        assert head.address.startswith("http://127.0.0.1:")
        lines = list(head.submit(["python", "ray_jobs/stage1.py", "--config", "configs/tiny/stage1.yaml",
                                  "--set", f"data.train={corpus}",
                                  "--set", "trainer.max_steps=2", "--set", "trainer.eval_every=2",
                                  "--set", "tracking.experiment=raoe-submitted"], {"env_vars": env}, cwd=root))
    assert head.returncode == 0, "".join(lines[-30:])
    result = json.loads(next(line for line in reversed(lines) if line.startswith('{"job"')))
    assert (result["rows_in"], result["rows_written"], result["corpus_cache"]) == (128, 128, "written")
    home = tmp_path / "home"
    assert result["model_path"].startswith(str(home)) and result["checkpoint_path"].startswith(str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    previous = mlflow.get_tracking_uri()  # an earlier test may have set the process-wide URI
    mlflow.set_tracking_uri(store)
    experiment = mlflow.MlflowClient(store).get_experiment_by_name("raoe-submitted")
    assert "_ray_pkg_" not in experiment.artifact_location
    assert experiment.artifact_location.startswith((tmp_path / "mlartifacts").as_uri())  # beside the store
    try:
        model = mlflow.sentence_transformers.load_model(result["model_uri"])  # the cluster and its copy are gone
    finally:
        mlflow.set_tracking_uri(previous)
    assert model.encode(["a man plays music."]).shape[0] == 1
    # no secret the job could see reached its output, the MLflow store, its artifacts, checkpoints or exports
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in written) and any("checkpoint" in str(p) for p in written)
    for value in secrets.values():
        assert not any(value in line for line in lines), value
        assert not [str(p) for p in written if value.encode() in p.read_bytes()], value
