"""Whole checkpoints only: manifests written last, checked on resume; a checkpoint that is not whole is passed over
for the newest whole one before it (the end-to-end case: test_recovery_and_registry.py)."""

from types import SimpleNamespace

import pytest
import torch

from training.checkpoints import problem, usable, write_manifest


def _checkpoint(run, name, ranks=(0,)):
    folder = run / name
    for rank in ranks:
        (folder / f"rank{rank}").mkdir(parents=True, exist_ok=True)
        before = set(folder.rglob("*"))
        (folder / f"rank{rank}" / "weights.bin").write_bytes(bytes(range(200)) * (rank + 1))
        write_manifest(folder, rank, {p for p in before if p.is_file()})
    return folder


def test_each_kind_of_damage_is_named_and_an_earlier_whole_checkpoint_is_used(tmp_path):
    run = tmp_path / "run"
    older = _checkpoint(run, "checkpoint_2026-01-01_00-00-01", ranks=(0, 1))
    latest = _checkpoint(run, "checkpoint_2026-01-01_00-00-02", ranks=(0, 1))
    assert problem(latest) is None and usable(latest) == (latest, [])
    weights = latest / "rank1" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])  # half-written
    assert problem(latest) == "rank1/weights.bin has 100 bytes, 400 were written"
    folder, notes = usable(latest)
    assert folder == older and "checkpoint_2026-01-01_00-00-02 is not whole" in notes[0]
    weights.write_bytes(bytes(400))  # right size, wrong bytes
    assert problem(latest) == "rank1/weights.bin does not match its checksum"
    weights.unlink()
    assert problem(latest) == "rank1/weights.bin is missing"
    (older / "manifest-rank0.json").write_text("{trunc")
    assert usable(latest)[0] is None and len(usable(latest)[1]) == 2


class _Payload:
    """What a tampered checkpoint could carry: an object whose unpickling runs code (here: writes a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-process gloo group for the module (DeepSpeed caches its groups: one group serves every stage)."""
    import os

    import torch.distributed as dist

    from runtime.local_head import free_port

    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")  # what Ray Train's workers have
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_deepspeed_checkpoints_load_weights_only(tmp_path, one_rank_group, zero_stage, monkeypatch):
    """DeepSpeed's own engine unpickles anything (torch.load(weights_only=False)); raoe's loads every ZeRO stage's
    files weights-only: the optimizer state comes back exactly, and a checkpoint carrying a code-running object is
    refused before the object is built. Starting DeepSpeed compiles nothing: its inference-only shared-memory
    all-reduce (35-80 s of g++ in a fresh extensions cache) is not built."""
    import pickle

    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))

    from jobconfig.schema import TrainerConfig
    from training.strategy import DeepSpeedStrategy, check_zero_partitions

    def strategy(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
        cfg = TrainerConfig(strategy="deepspeed", lr=1e-2, weight_decay=0.01, grad_clip=1.0, zero_stage=zero_stage,
                            bf16=False)
        plan = SimpleNamespace(micro_batch=4, grad_accum=1, global_batch=4, warmup_steps=0, total_steps=10, world=1,
                               chunks_per_micro=1)
        return DeepSpeedStrategy(model, cfg, plan, 1)

    trained = strategy(0)
    for _ in range(2):
        trained.backward(trained.module(torch.randn(4, 6)).pow(2).sum())
        trained.micro_step()
    trained.save(tmp_path, 0, {"step": 2, "history": [{"step": 2, "loss": 0.5}]})
    resumed = strategy(1)
    state = resumed.load(tmp_path)
    assert (state["step"], state["history"]) == (2, [{"step": 2, "loss": 0.5}])
    x = torch.randn(4, 6)
    assert torch.equal(resumed.module(x), trained.module(x))
    for each in (trained, resumed):  # one more identical step: the optimizer state came back too
        each.backward(each.module(x).pow(2).sum())
        each.micro_step()
    assert torch.equal(resumed.module(x), trained.module(x))

    if zero_stage:  # its optimizer partitions are one worker's: refused by name on two
        with pytest.raises(ValueError, match="partitions for 1 workers and trainer.num_workers is 2"):
            check_zero_partitions(tmp_path, zero_stage, 2)
    check_zero_partitions(tmp_path, zero_stage, 1)

    marker = tmp_path / "pwned"
    trained.save(tmp_path, 0, {"step": 3, "payload": _Payload(marker)})
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        strategy(2).load(tmp_path)
    assert not marker.exists()
    assert not extensions.exists()
