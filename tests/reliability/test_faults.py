"""The fault matrix's long variants (marker ``reliability``, left out of ``make test``; run and tabulated by
``benchmarks/reliability.py``). Each injects its fault from outside the job, as a cluster would, against one tiny
Stage 1 job (64 pairs, 8 steps of 16, a checkpoint every 2 steps, dropout 0.1) run as a user runs it, and compares
the end state with an uninterrupted run of the same job. Measurements go to $RAOE_RELIABILITY_OUT (JSON lines)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.reliability
ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
JOB = ["ray_jobs/stage1.py", "--config", "configs/tiny/stage1.yaml", "--set", "data.max_rows=64",
       "--set", "trainer.global_batch_size=16", "--set", f"trainer.max_steps={STEPS}", "--set", "trainer.eval_every=2",
       "--set", "model.dropout=0.1", "--set", "eval.data_dir=/nonexistent", "--set", "tracking.experiment=faults"]


def record(fault: str, **values) -> None:
    out = os.environ.get("RAOE_RELIABILITY_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"fault": fault, **values}) + "\n")


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "RAOE_HOME": str(root / "home"),
           "HF_HUB_OFFLINE": "1", "RAOE_MLFLOW_ARTIFACTS": str(root / "artifacts")}
    return root, env


def job_args(root: Path, name: str) -> list[str]:
    return [*JOB, "--set", f"tracking.run_name={name}", "--set", f"trainer.storage_path={root / 'runs'}",
            "--set", f"output_dir={root / 'models'}"]


def run_job(root, env, name, extra_env=None, extra_args=()) -> tuple[dict, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *job_args(root, name), *extra_args], cwd=ROOT, env={**env, **(extra_env or {})},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.monotonic() - started


def losses(env, run_id: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    history = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_metric_history(run_id, "train_loss")
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def wait_for_step(env, name: str, step: int, timeout: float = 300) -> None:
    from mlflow import MlflowClient

    client, deadline = MlflowClient(env["MLFLOW_TRACKING_URI"]), time.monotonic() + timeout
    while time.monotonic() < deadline:
        experiment = client.get_experiment_by_name("faults")
        runs = client.search_runs([experiment.experiment_id], f"tags.`mlflow.runName` = '{name}'") if experiment else []
        if runs and any(m.step >= step for m in client.get_metric_history(runs[0].info.run_id, "train_loss")):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{name} never logged step {step}")


@pytest.fixture(scope="module")
def reference(place):
    root, env = place
    result, seconds = run_job(root, env, "uninterrupted")
    return result, seconds, dict(losses(env, result["run_id"]))


def check_same_end(env, reference, result) -> dict:
    """The interrupted run ends on the same step and last loss as the uninterrupted one; what it replayed."""
    ref_result, _, ref_losses = reference
    logged = losses(env, result["run_id"])
    final = dict(logged)
    assert result["metrics"]["steps"] == STEPS and sorted(final) == list(range(1, STEPS + 1))
    assert final[STEPS] == pytest.approx(ref_losses[STEPS], rel=1e-6)
    return {"steps_replayed": len(logged) - STEPS, "final_loss": final[STEPS], "reference_loss": ref_losses[STEPS]}


# the job script with its workers pausing after a step, so that a fault aimed at that step lands before the job ends
PAUSED = ["tests/reliability/paused_job.py", "5", "120"]


def test_driver_killed_and_resubmitted(place, reference):
    root, env = place
    proc = subprocess.Popen([sys.executable, *PAUSED, *job_args(root, "driver-killed")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_step(env, "driver-killed", 5)
    # the job's process group, as a lost machine would: the driver and the local Ray it started (killing the
    # driver alone leaves that Ray's processes behind, which kept a later head's job agent from registering)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)
    result, seconds = run_job(root, env, "driver-killed")
    end = check_same_end(env, reference, result)
    assert result["resumed"] is True and end["steps_replayed"] >= 1
    record("job driver SIGKILLed after step 5, same run name resubmitted", **end, resubmit_seconds=seconds,
           uninterrupted_seconds=reference[1], data_lost="none (checkpoints every 2 steps on trainer.storage_path)")


def test_head_restarted_and_resubmitted(place, reference):
    import ray

    from runtime.local_head import AGENT_NOT_READY, LocalHead, head_env

    root, env = place
    if ray.is_initialized():
        ray.shutdown()
    clean = head_env()
    for key in ("MLFLOW_TRACKING_URI", "RAOE_MLFLOW_ARTIFACTS", "RAOE_HOME"):
        clean.pop(key, None)
    job_env = {k: env[k] for k in ("MLFLOW_TRACKING_URI", "RAOE_HOME", "HF_HUB_OFFLINE", "RAOE_MLFLOW_ARTIFACTS")}
    with LocalHead(clean) as head:
        cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", head.address, "--no-wait",
               "--working-dir", ".", "--runtime-env-json", json.dumps({"env_vars": job_env}), "--", "python",
               *PAUSED, *job_args(root, "head-restarted")]
        for _ in range(10):  # the head's job agent may not be up yet (LocalHead.submit repeats the same way)
            done = subprocess.run(cmd, cwd=ROOT, env=head.env, capture_output=True, text=True, timeout=300)
            if done.returncode == 0 or AGENT_NOT_READY not in done.stdout + done.stderr:
                break
            time.sleep(3)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        wait_for_step(env, "head-restarted", 5)
    # stopping the head took the job and its workers down; a new head, the same job submitted again
    started = time.monotonic()
    with LocalHead(clean) as head:
        lines = list(head.submit(["python", *job_args(root, "head-restarted")], {"env_vars": job_env}, cwd=ROOT))
    seconds = time.monotonic() - started
    assert head.returncode == 0, "".join(lines[-40:])
    result = json.loads(next(line for line in reversed(lines) if line.startswith('{"job"')))
    end = check_same_end(env, reference, result)
    assert result["resumed"] is True
    record("Ray head stopped after step 5, restarted, job resubmitted", **end, resubmit_seconds=seconds,
           uninterrupted_seconds=reference[1], data_lost="none (trainer.storage_path outside the cluster)")


def test_tracking_server_down_mid_run(place, reference):
    from runtime.local_head import free_port
    from tests.foundation.test_tracking_outage import start_server, stop

    root, env = place
    port = free_port()
    server_root = root / "server"
    server_root.mkdir()
    server = start_server(port, server_root)
    uri = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, *job_args(root, "tracking-outage")], cwd=ROOT,
                            env={**env, "MLFLOW_TRACKING_URI": uri}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wait_for_step({**env, "MLFLOW_TRACKING_URI": uri}, "tracking-outage", 3)
    stop(server)
    down = time.monotonic()
    time.sleep(20)
    server = start_server(port, server_root)
    outage = time.monotonic() - down
    try:
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output[-3000:]
        result = json.loads(output.strip().splitlines()[-1])
        end = check_same_end({**env, "MLFLOW_TRACKING_URI": uri}, reference, result)
        assert result["model_uri"] and end["steps_replayed"] == 0
        assert "buffering them and training on" in output
    finally:
        stop(server)
    record("MLflow tracking server stopped for the middle of the run, then restarted", **end,
           outage_seconds=outage, uninterrupted_seconds=reference[1],
           data_lost="none (step metrics buffered and written on return; model registered)")


@pytest.fixture
def small_disk(place):
    """A 64 MiB tmpfs mounted for one test: storage that can be filled or made read-only from outside the job."""
    root, _ = place
    mount = root / "small-disk"
    mount.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def first_registered_checkpoint(run_folder: Path, timeout: float = 300) -> str:
    """Wait until Ray Train has registered a checkpoint of the run (its snapshot names one); its folder name."""
    snapshot, deadline = run_folder / "checkpoint_manager_snapshot.json", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            names = [r["checkpoint_dir_name"] for r in json.loads(snapshot.read_text())["checkpoint_results"]]
        except (OSError, ValueError, KeyError, TypeError):
            names = []
        if names:
            return names[0]
        time.sleep(0.02)
    raise TimeoutError(f"no checkpoint registered in {run_folder}")


def fill(mount: Path) -> None:
    with open(mount / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_checkpoint_storage_full_or_read_only(place, reference, small_disk, fault):
    """The storage fills up (or turns read-only) once the run has a checkpoint: the job fails with an error naming
    the path and the OS reason; every checkpoint it had stays whole; after the storage is fixed, the same job
    resubmitted resumes and ends where an uninterrupted run ends."""
    from training.checkpoints import problem

    root, env = place
    name = f"storage-{fault}"
    args = [*job_args(root, name), "--set", f"trainer.storage_path={small_disk}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first_registered_checkpoint(small_disk / name)
    if fault == "full":
        fill(small_disk)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    output = proc.communicate(timeout=600)[0]
    broken = time.monotonic()
    result = json.loads(output.strip().splitlines()[-1])
    assert proc.returncode != 0 and result["status"] == "error", output[-3000:]
    reason = "No space left on device" if fault == "full" else "Read-only file system"
    assert reason in result["error"] and str(small_disk) in result["error"], result["error"]
    kept = sorted(p for p in (small_disk / name).glob("checkpoint_*") if p.is_dir())
    assert kept and all(problem(p) is None for p in kept), [(p.name, problem(p)) for p in kept]
    # a worker's checkpoint upload fails ("the step N checkpoint"), or Ray Train's controller rewriting its record
    # of the checkpoints does, whichever touches the storage first: the same advice either way
    assert "could not write" in result["error"] and "resubmit the same job" in result["error"], result["error"]
    failed = "Ray Train's checkpoint record" if "checkpoint record" in result["error"] else \
        "the step " + result["error"].split("could not write the step ")[1].split()[0] + " checkpoint"

    if fault == "full":
        (small_disk / "filler").unlink()
    else:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    resumed, seconds = run_job(root, env, name, extra_args=["--set", f"trainer.storage_path={small_disk}"])
    end = check_same_end(env, reference, resumed)
    assert resumed["resumed"] is True
    record(f"checkpoint storage {'full' if fault == 'full' else 'turned read-only'} after the first checkpoint, "
           f"fixed, job resubmitted", **end, failed_write=failed, error=result["error"],
           did=f"the job failed at once with `{reason}` naming the path ({failed}) and what to do; the "
               f"{len(kept)} checkpoints before it stayed whole (manifests checked); resubmitted, it resumed",
           resubmit_seconds=seconds, fix_to_done_seconds=time.monotonic() - broken,
           checkpoints_kept=len(kept), uninterrupted_seconds=reference[1],
           data_lost="none (the failed checkpoint was never registered; earlier ones stayed whole)")
