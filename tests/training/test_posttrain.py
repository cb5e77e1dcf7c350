"""ListMLE post-training on ranked lists: the objective ranks each row of the student's cosine matrix / tau by the
refined teacher targets, lists of different lengths are gathered and padded alike on every worker, and the job
gives the same loss and gradient norm on 1 and 2 workers."""

import json

import pytest
import torch

from objectives import listmle_loss, refine_targets
from objectives.composite import CompositeObjective, EmbeddingBatch
from tests.training.conftest import ONE_STEP_APART_REL, ROOT, SAME_START_REL, metric_by_step

LISTS = [json.loads(x)["sentences"] for x in (ROOT / "configs/tiny/data/lists.jsonl").read_text().splitlines()]


def test_listmle_ranks_student_cosines_by_the_refined_teacher_targets():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    teacher = torch.rand(2, 5, 5, generator=g, dtype=torch.float64)
    teacher = (teacher + teacher.transpose(1, 2)) / 2
    loss, _ = CompositeObjective({"listmle": 1.0}, {"listmle": {"omega": 0.7, "tau": 0.1}})(
        EmbeddingBatch(list_emb=emb, list_mask=mask, list_target=teacher))
    want = []
    for r, n in enumerate((5, 3)):
        e = torch.nn.functional.normalize(emb[r, :n], dim=-1)
        want.append(listmle_loss(e @ e.T / 0.1, refine_targets(teacher[r, :n, :n], 0.7)))
    assert loss.item() == pytest.approx(torch.stack(want).mean().item(), rel=1e-12)


def test_a_list_already_in_order_keeps_its_targets():
    # rows ordered by index: phi[i, k] decreases with k >= i, so the refinement changes nothing
    n = 5
    idx = torch.arange(n, dtype=torch.float64)
    phi = 1.0 - (idx[None, :] - idx[:, None]).abs() / n
    assert torch.allclose(refine_targets(phi, 0.5), phi)


def _config(root, name, data, *overrides):
    from jobconfig import load_config
    from jobconfig.schema import PosttrainJobConfig

    return load_config(PosttrainJobConfig, ROOT / "configs" / "tiny" / "posttrain.yaml", [
        f"tracking.run_name={name}", f"trainer.storage_path={root / 'runs'}", f"output_dir={root / 'models'}",
        f"eval.data_dir={root / 'no-dev-data'}", f"data.train={data}", "tracking.experiment=raoe-test",
        "model.dropout=0.0", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.warmup_ratio=0.0", "data.cache=false",
        *overrides])


SIZES = ("trainer.global_batch_size=2", "trainer.length_buckets=2")


@pytest.fixture(scope="module")
def alternating_lists(train_env, tmp_path_factory):
    """Lists of 2 and 6 sentences alternating, and the one-worker run on them (2 lists a step)."""
    from training.run import run_training

    data = tmp_path_factory.mktemp("lists") / "lists.jsonl"
    data.write_text("".join(json.dumps({"sentences": x[: 2 if i % 2 == 0 else 6]}) + "\n"
                            for i, x in enumerate(LISTS[:8])))
    return data, run_training(_config(train_env, "lists-1", data, *SIZES, "data.cache=true",
                                      "trainer.num_workers=0"))  # in the test's process (Ray Train's local mode)


@pytest.mark.parametrize("strategy", [("trainer.strategy=ddp",),
                                      ("trainer.strategy=deepspeed", "trainer.zero_stage=3")], ids=["ddp", "zero-3"])
def test_posttraining_is_the_same_on_one_and_two_workers(train_env, alternating_lists, strategy):
    """With 2 lists a step on 2 workers, one worker holds 2 texts (one forward pass), the other 6 (two length
    buckets on its own). Each forward pass is a collective (DDP buffers, ZeRO-3 weights), so the workers must agree
    on the pass count, else the run hangs in its next all-gather. The two-worker runs score their lists with two
    teacher actors (posttrain.teacher_actors): the same targets, so the same losses. The ZeRO-3 run reads the
    one-worker run's matrices back from the corpus cache (data.cache) instead: the same losses again, and no second
    entry (the pool size is not part of its key).
    About 35-40 s a strategy: a two-worker training run (with two teacher actors, or the cache under ZeRO-3); the
    one-worker run is the module's fixture, shared."""
    from training.run import run_training

    data, one = alternating_lists
    cached = strategy[-1] == "trainer.zero_stage=3"
    two = run_training(_config(train_env, f"lists-2-{strategy[-1]}", data, *SIZES, "trainer.num_workers=2", *strategy,
                               "posttrain.teacher_actors=2", f"data.cache={str(cached).lower()}"))
    if cached:
        entries = list((train_env / "runs" / "corpus_cache").glob("lists-teacher-*"))
        assert two["corpus_cache"] == "read" and len(entries) == 1
        assert len([a for a in entries[0].iterdir() if a.is_dir()]) == 1  # written once, by the one-worker run
    assert one["registered_model"] == "raoe-lists" and two["plan"]["micro_batch"] == 1
    for key in ("train_loss", "grad_norm"):
        expected, got = metric_by_step(one["run_id"], key), metric_by_step(two["run_id"], key)
        assert got[1] == pytest.approx(expected[1], rel=SAME_START_REL), key
        assert got[2] == pytest.approx(expected[2], rel=ONE_STEP_APART_REL), key


@pytest.mark.parametrize("model", [
    ("model.source=tiny:bert", "model.pooling=cls"),
    ("model.source=tiny:qwen2", "model.pooling=last_token", "model.padding_side=left",
     "model.prompt='This sentence: \"{text}\" means in one word:'", "model.max_length=24"),
], ids=["cls-pooled bert", "prompted causal lm"])
def test_the_default_teacher_is_the_start_model_encoding_as_training_does(tmp_path, model):
    """The targets come from the frozen start model's similarities: its pooling, prompt and padding, not
    sentence-transformers' defaults for a plain checkpoint (mean pooling, no prompt, 128 tokens)."""
    import numpy as np
    import pyarrow as pa

    from encoders.backbone import build_encoder, inference_embeddings
    from encoders.model_uris import resolve_model
    from training.kinds.lists import ListTeacher, list_teacher_kwargs

    cfg = _config(tmp_path, "teacher", tmp_path / "lists.jsonl", *model)
    lists = [LISTS[0][:4], LISTS[1][:3]]
    out = ListTeacher(**list_teacher_kwargs(cfg, cfg.model.source))(pa.table({"sentences": lists}))
    student = build_encoder(resolve_model(cfg.model.source), pooling=cfg.model.pooling, max_length=cfg.model.max_length,
                            prompt=cfg.model.prompt, padding_side=cfg.model.padding_side, dropout=0.0)
    for sentences, got in zip(lists, out["teacher_sim"].to_numpy(zero_copy_only=False)):
        emb = inference_embeddings(student, sentences)
        emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
        np.testing.assert_allclose(got.reshape(len(sentences), -1), emb @ emb.T, atol=1e-5)


def test_the_teacher_cache_key_follows_the_lists_content_and_the_teacher_not_their_order(ray_local):
    """The same lists in another order and block split, or scored on other devices, share an entry; a teacher that
    encodes otherwise (another max length) does not."""
    import ray

    from training.kinds.lists import teacher_key

    rows = [{"sentences": x[:4]} for x in LISTS[:6]]
    kwargs = {"source": "tiny:bert", "batch_size": 64, "trust_remote_code": False, "gpus": 0.0,
              "encoder": {"pooling": "mean", "max_length": 32, "prompt": None, "padding_side": None}}
    key = teacher_key(ray.data.from_items(rows, override_num_blocks=1), kwargs)
    assert teacher_key(ray.data.from_items(rows[::-1], override_num_blocks=3), {**kwargs, "gpus": 1.0}) == key
    longer = {**kwargs, "encoder": {**kwargs["encoder"], "max_length": 64}}
    assert teacher_key(ray.data.from_items(rows, override_num_blocks=1), longer) != key
    assert teacher_key(ray.data.from_items(rows[:-1], override_num_blocks=1), kwargs) != key
