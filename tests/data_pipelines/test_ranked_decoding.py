"""Directionally controlled decoding: lam = 0 is transformers' greedy generate, batched with left padding; lam > 0
picks argmax of (1 + lam) log p(.|prev) - lam log p(.|prev2) at every step."""

import pytest
import torch

from data_pipelines.ranked import directed_greedy
from encoders.sources import resolve_model_source

PROMPTS = ["a man is playing music", "two dogs", "the woman is eating food in the park with a child"]
OTHER = ["a girl rides a bike", "the city at night is big and old", "a cat"]


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_source("tiny:qwen2-lm")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _generate(model, tokenizer, prompts, n):
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=n, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_lam_zero_is_greedy_generate(lm):
    model, tokenizer = lm
    want = _generate(model, tokenizer, PROMPTS, 12)
    assert directed_greedy(model, tokenizer, PROMPTS, None, lam=0.5, max_new_tokens=12) == want
    assert directed_greedy(model, tokenizer, PROMPTS, OTHER, lam=0.0, max_new_tokens=12) == want


def _reference(model, tokenizer, prompt, other, lam, n):
    """Both conditions recomputed from scratch at every step: no cache, no batching, no padding."""
    a, b = (tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"] for p in (prompt, other))
    tokens = []
    with torch.no_grad():
        for _ in range(n):
            la = torch.log_softmax(model(input_ids=a).logits[0, -1], -1)
            lb = torch.log_softmax(model(input_ids=b).logits[0, -1], -1)
            t = int(((1 + lam) * la - lam * lb).argmax())
            tokens.append(t)
            a, b = torch.cat([a, torch.tensor([[t]])], 1), torch.cat([b, torch.tensor([[t]])], 1)
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.5])
def test_batched_guided_decoding_equals_the_two_pass_reference_one_prompt_at_a_time(lm, lam):
    model, tokenizer = lm
    batched = directed_greedy(model, tokenizer, PROMPTS, OTHER, lam=lam, max_new_tokens=6)
    single = [directed_greedy(model, tokenizer, [p], [o], lam=lam, max_new_tokens=6)[0] for p, o in zip(PROMPTS, OTHER)]
    assert batched == single == [_reference(model, tokenizer, p, o, lam, 6) for p, o in zip(PROMPTS, OTHER)]
    if lam > 0:
        assert batched != directed_greedy(model, tokenizer, PROMPTS, None, lam=0, max_new_tokens=6)


@pytest.mark.parametrize("exact_work", [200_000_000, 0])  # scipy's exact k-means; mini-batch k-means (at scale)
def test_kmeans_seeds_are_diverse_and_deterministic(monkeypatch, exact_work):
    import numpy as np

    import data_pipelines.ranked as ranked
    from data_pipelines.ranked import kmeans_seeds

    monkeypatch.setattr(ranked, "EXACT_KMEANS_WORK", exact_work)
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 8)) * 10
    points = np.concatenate([c + rng.normal(size=(25, 8)) for c in centers])  # 4 clear clusters of 25
    chosen = kmeans_seeds(points, clusters=4, per_cluster=3, seed=7)
    assert chosen == kmeans_seeds(points, clusters=4, per_cluster=3, seed=7)
    assert len(chosen) == 12 and sorted({i // 25 for i in chosen}) == [0, 1, 2, 3]  # three from every cluster
    assert chosen != kmeans_seeds(points, clusters=4, per_cluster=3, seed=8)


@pytest.mark.parametrize("sentence, reason", [("", "empty"), ("...", "empty"), ("A man sits.", "repeated"),
                                              ("a man sits .", "repeated"),
                                              ("the the the the end", "looping"),
                                              ("a big dog a big dog a big dog", "looping"), ("A woman runs.", None)])
def test_list_checks(sentence, reason):
    from data_pipelines.ranked import check_sentence

    assert check_sentence(sentence, ["a man sits.", "Two men sit."]) == reason


def test_generate_lists_job_accounts_for_every_seed(tmp_path, monkeypatch, s3):
    """The tiny config end to end: seeds are premises, lists are written (to object storage: the local S3
    endpoint), and the lam and lam = 0 lists are compared seed by seed even when the actor pool hands rows back in
    another order (here: reversed).
    About 45 s: the job end to end, its actor pools loading the seed encoder and, for each of its two decodings
    (every seed, then the compared seeds at lam = 0), the tiny language model."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "ray_jobs"))
    try:
        import generate_lists as job
    finally:
        sys.path.remove(str(root / "ray_jobs"))
    from jobconfig import load_config
    from storage.paths import storage_path

    pairs = root / "configs/tiny/data/nli_pairs.jsonl"
    cfg = load_config(job.GenerateListsJobConfig, root / "configs" / "tiny" / "generate_lists.yaml", [
        f"data.train={pairs}", f"output_dir={s3.uri('lists')}", "tracking.experiment=raoe-test",
        "lists.actors=1"])  # one actor per pool: the rows come back in another order through the reversal below
    from tests.conftest import mlflow_store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    generate = job._generate
    monkeypatch.setattr(job, "_generate", lambda *args: generate(*args).iloc[::-1])
    result = job.main(cfg)
    premises = {json.loads(line)["text1"] for line in open(pairs)}
    assert "status" not in result and result["seeds_from"] == "premises" and result["seed_column"] == "text1"
    assert result["seed_candidates"] == len(premises) and result["seeds"] == 8
    assert result["lists_written"] >= 1 and result["lists_written"] + result["lists_without_sentences"] == 8
    assert result["lists_stopped_early"] == sum(result["stopped"].values())
    assert result["output_path"] == s3.uri("lists/data") and result["plot"] == s3.uri("lists/similarity_by_position.png")
    assert storage_path(result["plot"]).read_bytes().startswith(b"\x89PNG")
    written = storage_path(f"{result['output_path']}/lists.jsonl").read_text().splitlines()
    lists = [json.loads(x)["sentences"] for x in written]
    assert len(lists) == result["lists_written"] and sum(map(len, lists)) == result["sentences"]
    assert all(x[0] in premises for x in lists)
    compared = [json.loads(x) for x in storage_path(result["compared_path"]).read_text().splitlines()]
    assert len(compared) == result["lists_compared"] == 4
    assert all(c["lam"][0] == c["lam0"][0] == c["seed"] for c in compared)
    curves = result["similarity_by_position"]
    assert len(curves) == 2 and all(c[0] == pytest.approx(1.0) for c in curves.values())


@pytest.mark.parametrize("output, sentence", [
    (' "A man sits on a bench." He is tired.\nMore', "A man sits on a bench."),
    ("Two dogs run. Then they stop", "Two dogs run."),
    ("men walking by the river", "men walking by the river"),
    ('She said "hi." and left', 'She said "hi."'),
])
def test_only_the_first_generated_sentence_is_kept(output, sentence):
    from data_pipelines.ranked import first_sentence

    assert first_sentence(output) == sentence
