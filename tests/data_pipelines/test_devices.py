"""The data jobs' GPU placement, tested on CPU: which device an actor picks, what its pool asks Ray for, and the
refusal of GPUs a local Ray cannot give. (A real GPU run needs the device machine: benchmarks/, not tests.)"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import data_pipelines.ranked as ranked
import data_pipelines.san as san
import data_pipelines.teachers as teachers
import evaluation.encode as encode
from encoders.devices import EncoderPool, actor_device, gpus_wanted_here, pool_resources


def test_an_actor_runs_on_its_gpu_when_it_reserved_one_and_cuda_is_there(monkeypatch, capsys):
    assert actor_device(0) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert actor_device(1) == actor_device(0.25) == "cuda" and actor_device(0) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert actor_device(1) == "cpu"
    assert "reserved 1 GPU(s) but torch sees no CUDA device" in capsys.readouterr().out  # said, not silent


def test_a_pool_asks_for_gpus_only_when_its_actors_want_them():
    assert pool_resources(0.5, 0.0) == {"num_cpus": 0.5}  # CPU pools exactly as before: no num_gpus at all
    assert pool_resources(1.0, 0.5) == {"num_cpus": 1.0, "num_gpus": 0.5}


def test_gpus_a_local_ray_cannot_give_are_refused_by_key_before_ray_starts(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    gpus_wanted_here({"san.gpus_per_actor": 0.0})  # none asked: fine
    with pytest.raises(ValueError, match=r"san.gpus_per_actor=1 asks for GPUs, but this machine has 0"):
        gpus_wanted_here({"san.gpus_per_actor": 1.0})
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # a submitted job: the cluster may have them
    gpus_wanted_here({"san.gpus_per_actor": 1.0})


def test_a_job_asking_for_gpus_here_fails_before_ray_with_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "ray_jobs/generate_san.py", "--config", "configs/tiny/generate_san.yaml",
                           "--set", "san.gpus_per_actor=1", "--set", f"output_dir={tmp_path}/san"],
                          capture_output=True, text=True,
                          env={**os.environ, "RAY_ADDRESS": "", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "san.gpus_per_actor=1 asks for GPUs" in proc.stdout.strip().splitlines()[-1]
    assert "Started a local Ray" not in proc.stderr + proc.stdout


class _Pools:
    """Stands in for a Ray Dataset: records what each map_batches asks for."""

    def __init__(self):
        self.calls = []

    def map_batches(self, fn, **kwargs):
        self.calls.append({"fn": getattr(fn, "__name__", str(fn)), **kwargs})
        return self

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame({"seed_id": []})

    def take_all(self):
        return [{"idx": 0, "embedding": np.zeros(2, np.float32)}]


@pytest.mark.parametrize("gpus", [0.0, 0.5])
def test_every_data_job_pool_reserves_the_gpus_its_config_asks_for(monkeypatch, gpus):
    import ray.data

    jobs = str(Path(__file__).resolve().parents[2] / "ray_jobs")
    sys.path.insert(0, jobs)
    try:
        from generate_lists import ListsSection, _generate
    finally:
        sys.path.remove(jobs)

    pools = _Pools()
    monkeypatch.setattr(ray.data, "from_items", lambda *a, **k: pools)
    san.generate_negatives(pools, san.SanConfig(gpus_per_actor=gpus))
    teachers.add_teacher_scores(pools, [teachers.TeacherConfig(name="a", source="tiny:bert", gpus_per_actor=gpus),
                                        teachers.TeacherConfig(name="b", source="tiny:bert")])
    _generate({0: "a seed"}, ListsSection(gpus_per_actor=gpus), lam=0.5)
    encode.ray_encode("unused", ["a sentence"], pool=EncoderPool(gpus_per_actor=gpus))
    actors = [c for c in pools.calls if "compute" in c]
    assert [c["fn"] for c in actors] == ["SanGenerator", "TeacherScorer", "ListGenerator", "SentenceEncoderActor"]
    for call in actors:
        assert call.get("num_gpus") == (gpus or None), call
    constructor_gpus = [actors[0]["fn_constructor_kwargs"]["cfg"]["gpus_per_actor"],
                        max(c["gpus_per_actor"] for c in actors[1]["fn_constructor_kwargs"]["cfgs"]),
                        actors[2]["fn_constructor_kwargs"]["gpus"], actors[3]["fn_constructor_kwargs"]["gpus"]]
    assert constructor_gpus == [gpus] * 4  # and each actor places its model by them


def test_each_actor_places_its_model_on_the_device_its_gpus_give(monkeypatch):
    """With 1 GPU asked and the device choice recorded (CPU here), each actor builds on that device and runs."""
    asked = []

    def device(gpus):
        asked.append(gpus)
        return "cpu"

    for module in (san, teachers, ranked, encode):
        monkeypatch.setattr(module, "actor_device", device)
    generator = san.SanGenerator(san.SanConfig(model="tiny:bert-mlm", tagging="static", iterations=1,
                                               gpus_per_actor=1).model_dump())
    assert generator.generator.model.device.type == "cpu"
    out = generator({"text": np.array(["a man is sitting on a bench in the park today", "rain"], dtype=object)})
    assert out["guard"][1] == "too_short" and out["negative"][0]
    scorer = teachers.TeacherScorer([teachers.TeacherConfig(name="t", source="tiny:bert", gpus_per_actor=1)
                                     .model_dump()])
    assert scorer.encoders[0].model.device.type == "cpu"
    assert scorer({"text1": np.array(["a cat"]), "text2": np.array(["a dog"])})["s_t"].shape == (1,)
    lists = ranked.ListGenerator("tiny:qwen2-writer", "{sentence}", steps=1, lam=0.5, max_new_tokens=4, gpus=1)
    assert lists.model.device.type == "cpu"
    assert asked == [1, 1, 1]


def test_a_shard_pool_gives_a_shard_to_each_actor_while_another_runs(ray_local, tmp_path):
    """Two shards, two actors: the actor that takes the first shard runs it until another call has begun, so the
    other actor must take the second. Ray Data's default lets the first actor up queue both shards (it then waits out
    the deadline and the test fails); a corpus index's shard is minutes of encoding, so the other actor idled
    through a whole build."""
    import time

    import ray

    from encoders.devices import shard_pool

    class WaitsForAnotherCall:
        def __init__(self, folder: str):
            self.folder = Path(folder)

        def __call__(self, batch):
            (self.folder / str(os.getpid())).touch()
            deadline = time.monotonic() + 60
            while len(list(self.folder.iterdir())) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            return {"pid": np.full(len(batch["shard"]), os.getpid())}

    shards = ray.data.from_items([{"shard": 0}, {"shard": 1}], override_num_blocks=2)
    ran = shards.map_batches(WaitsForAnotherCall, batch_size=1, compute=shard_pool(2), num_cpus=0.5,
                             fn_constructor_args=(str(tmp_path),)).take_all()
    assert len({row["pid"] for row in ran}) == 2
