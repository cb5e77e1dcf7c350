"""SAN negatives: POS-importance masking rates, static vs dynamic tagging, fill only masked words with the anchor's
casing, reproducible seeds, the guard, LLM output parsing, and every valid anchor kept in the job's corpus."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from data_pipelines.san import (
    GUARD_REASONS,
    POS_IMPORTANCE,
    LlmRewriter,
    MaskFiller,
    SanConfig,
    Tagger,
    changes,
    guard_reason,
    parse_rewrite,
    words_of,
)
from encoders.sources import resolve_model_source

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = [json.loads(x)["text"] for x in (ROOT / "configs/tiny/data/sentences_san.jsonl").read_text().splitlines()]
# Function words whose Penn tag alone misleads (VBZ 'is' -> VERB, RB 'not' -> ADV, IN 'because' -> ADP), in sentences
# whose nouns and verbs are unambiguous alone too.
FUNCTION_WORDS = {"AUX": "is are was were be been has have do does did will would can could should might must",
                  "PART": "not n't to", "SCONJ": "because although if while since", "DET": "the a this every"}
FUNCTION_SENTENCES = [
    "The dog is running in the city.", "They are eating apples.", "It was raining in the city.",
    "We were sleeping in a tent.", "It will be fine.", "It has been raining all day.", "She has eaten the bread.",
    "They have finished the bread.", "Do you know the man?", "He does not drink tea.", "We did not see the car.",
    "She would buy a car.", "I can swim in the sea.", "He could read the letter.", "You should see a doctor.",
    "The child might cry.", "You must leave the room.", "I don't want to go.", "She stayed inside because it rained.",
    "Although it rained, we played.", "If you ask, we stay.", "He sang while she danced.",
    "Since you asked, I will tell you.", "This car is red.", "Every child likes the game.", "A girl reads a letter.",
]


@pytest.fixture(scope="module")
def filler():
    return MaskFiller(SanConfig(model="tiny:bert-mlm", iterations=1), resolve_model_source("tiny:bert-mlm"))


def test_mask_rates_follow_pos_importance_over_scale(filler):
    masked, seen = Counter(), Counter()
    for iteration in range(6):
        for text in SENTENCES:
            words, spaces = words_of(filler.tagger.nlp, text)
            tags, chosen = filler.choose_masks(text, words, spaces, iteration)
            seen.update(tags)
            masked.update(tags[i] for i in chosen)
    for tag in ("NOUN", "VERB", "DET", "ADP", "PUNCT"):
        n, p = seen[tag], POS_IMPORTANCE[tag] / 20
        assert n > 300, tag
        bound = 4 * np.sqrt(p * (1 - p) / n)  # 4 standard errors
        assert abs(masked[tag] / n - p) < bound, (tag, masked[tag] / n, p)


def test_static_and_dynamic_tagging_agree_on_unambiguous_words():
    static = Tagger("static", ["the", "a", "dog", "girl", "runs", "eats", "quickly", "beautiful", "in", "two", "."])
    dynamic = Tagger("dynamic")
    words, spaces = words_of(static.nlp, "The dog quickly eats two beautiful apples in a garden.")
    want = ["DET", "NOUN", "ADV", "VERB", "NUM", "ADJ", "NOUN", "ADP", "DET", "NOUN", "PUNCT"]
    assert static(words, spaces) == dynamic(words, spaces) == want  # 'the' is DET, not the PRON of a lone 'the'


def test_static_tagging_agrees_with_dynamic_on_function_words():
    static, dynamic = Tagger("static"), Tagger("dynamic")
    for text in FUNCTION_SENTENCES:
        words, spaces = words_of(static.nlp, text)
        assert static(words, spaces) == dynamic(words, spaces), text
    for pos, words in FUNCTION_WORDS.items():
        assert {w: static([w], [""])[0] for w in words.split()} == dict.fromkeys(words.split(), pos)


def test_function_words_are_masked_at_their_table_2_rate(filler):
    """Static tagging (the default): 'is' masked with p = AUX 4 / 20 per round, not VERB 9 / 20."""
    pos_of = {w: pos for pos, words in FUNCTION_WORDS.items() for w in words.split()}
    masked, seen = Counter(), Counter()
    for iteration in range(100):
        for text in FUNCTION_SENTENCES:
            words, spaces = words_of(filler.tagger.nlp, text)
            tags, chosen = filler.choose_masks(text, words, spaces, iteration)
            for index, word in enumerate(words):
                if word.lower() in pos_of:
                    assert tags[index] == pos_of[word.lower()], (text, word)
                    seen[tags[index]] += 1
                    masked[tags[index]] += index in set(chosen)
    for tag, n in seen.items():
        p = POS_IMPORTANCE[tag] / 20
        assert abs(masked[tag] / n - p) < 4 * np.sqrt(p * (1 - p) / n), (tag, masked[tag] / n, p)


def test_fill_changes_only_masked_words_and_keeps_casing_and_spacing(filler):
    text = "The Dog is running in the park , NOW."
    words, spaces = words_of(filler.tagger.nlp, text)
    _, chosen = filler.choose_masks(text, words, spaces, 0)
    assert 0 < len(chosen) < len(words)
    out = filler.rewrite([text])[0]
    new_words, new_spaces = words_of(filler.tagger.nlp, out)
    kept = [i for i in range(len(words)) if i not in set(chosen)]
    if len(new_words) == len(words):  # a replacement may be two words; then compare the unmasked prefix only
        assert all(new_words[i] == words[i] for i in kept)
        assert all(new_words[i][:1].isupper() for i in chosen if words[i][:1].isupper())
    assert out.startswith(words[0]) or 0 in set(chosen)


def test_negatives_are_reproducible_by_seed():
    path = resolve_model_source("tiny:bert-mlm")
    one = MaskFiller(SanConfig(model="tiny:bert-mlm", fill="sample", seed=1), path).rewrite(SENTENCES[:8])
    again = MaskFiller(SanConfig(model="tiny:bert-mlm", fill="sample", seed=1), path).rewrite(SENTENCES[:8])
    other = MaskFiller(SanConfig(model="tiny:bert-mlm", fill="sample", seed=2), path).rewrite(SENTENCES[:8])
    assert one == again and one != other


def test_the_guard_keeps_junk_out(filler):
    nlp, cfg = filler.tagger.nlp, SanConfig()
    assert guard_reason("Stafford acting General Secretary.", "-., p.", nlp, cfg) == "mostly_punctuation"
    assert guard_reason("A man sits.", "a man sits.", nlp, cfg) == "unchanged"
    assert guard_reason("A man sits on a dirt track .", "A man sits on a dirt track.", nlp, cfg) == "unchanged"
    assert guard_reason("A man sits.", "  ", nlp, cfg) == "unparseable"
    assert guard_reason("A man sits.", "A woman stands.", nlp, cfg) is None


def test_changes_count_per_pos_and_overlap():
    per_pos, overlap = changes(["A", "man", "sits", "."], ["DET", "NOUN", "VERB", "PUNCT"], ["a", "woman", "sits", "."])
    assert per_pos == {"DET": [0, 1], "NOUN": [1, 1], "VERB": [0, 1], "PUNCT": [0, 1]} and overlap == 0.75


def test_llm_answers_are_parsed_and_every_sentence_gets_one():
    assert parse_rewrite(' Modified sentence: "A woman stands."\nNotes: ...') == "A woman stands."
    assert parse_rewrite("Modified sentence: {your-outputs}") == ""
    rewriter = LlmRewriter(SanConfig(method="llm", model="tiny:qwen2-lm", max_new_tokens=8, batch_size=3),
                           resolve_model_source("tiny:qwen2-lm"))
    prompt = rewriter.render("a dog runs.")  # the tiny LM has no chat template: the plain prompt
    assert "Original sentence: a dog runs." in prompt and prompt.endswith("Modified sentence:")
    out = rewriter.rewrite(SENTENCES[:5])
    assert len(out) == 5 and all(isinstance(x, str) for x in out)


def _generate_san_job():
    import sys

    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        import generate_san
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))
    return generate_san


def test_job_keeps_every_valid_anchor(ray_local, tmp_path, monkeypatch, s3):
    """Guarded anchors stay in the corpus (negative None, the guard's reason), like the paper's whole Wiki1M. The
    corpus is read from object storage (the local S3 endpoint) and every output is written there by the tasks."""
    import pyarrow.parquet as pq

    from storage.paths import storage_path

    job = _generate_san_job()
    corpus = tmp_path / "wiki.txt"
    corpus.write_bytes("\n".join(SENTENCES[:30]).encode() + b"\n?!\n\xff broken line\nToo short.\n...\nOk then it is.\n")
    cfg = job.GenerateSanJobConfig(data={"train": s3.upload(corpus, "wiki.txt"), "on_bad_record": "quarantine"},
                                   san={"model": "tiny:bert-mlm", "iterations": 2, "cpus_per_actor": 0.5},
                                   output_dir=s3.uri("san"), tracking={"experiment": "raoe-test"})
    from tests.conftest import mlflow_store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store(tmp_path))
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    result = job.main(cfg)
    assert result["rows_in"] == 35 and result["rows_quarantined"] == 3  # '?!', bad UTF-8, '...'
    assert result["rows_written"] == result["rows_in"] - result["rows_quarantined"] == 32
    assert result["rows_with_negative"] + result["rows_guarded"] == result["rows_written"]
    assert result["guarded"]["too_short"] == 1 and sum(result["guarded"].values()) == result["rows_guarded"]
    assert result["output_path"] == s3.uri("san/data") and result["quarantine_path"] == s3.uri("san/quarantine.jsonl")
    assert len(storage_path(result["quarantine_path"]).read_text().splitlines()) == 3
    shards = sorted(storage_path(result["output_path"]).glob("*.parquet"))
    table = pa.concat_tables(pq.read_table(shard.open("rb")) for shard in shards)
    assert table.column_names == ["text", "negative", "negative_reason", "overlap"]
    rows = table.to_pylist()
    assert len(rows) == result["rows_written"] and "Too short." in {r["text"] for r in rows}
    with_negative = [r for r in rows if r["negative"] is not None]
    assert len(with_negative) == result["rows_with_negative"] > 0
    assert all(r["negative_reason"] is None and r["negative"] != r["text"] for r in with_negative)
    guarded_rows = [r for r in rows if r["negative"] is None]
    assert all(r["negative_reason"] in GUARD_REASONS for r in guarded_rows)
    assert {r["text"]: r["negative_reason"] for r in guarded_rows}["Too short."] == "too_short"
    guarded = [json.loads(x) for x in storage_path(result["guarded_path"]).read_text().splitlines()]
    assert sorted((g["text"], g["reason"]) for g in guarded) == sorted((r["text"], r["negative_reason"])
                                                                         for r in guarded_rows)
    assert set(result["changed_share_by_pos"]) >= {"NOUN", "DET"} and result["plot"] == s3.uri("san/san_changes.png")
    assert storage_path(result["plot"]).read_bytes().startswith(b"\x89PNG")
    assert all(e["negative"] for e in result["examples"])


@pytest.mark.parametrize("output_format", ["parquet", "jsonl"])
def test_guarded_rows_read_back_as_sentences_without_a_negative(ray_local, tmp_path, output_format):
    import pandas as pd
    import ray

    from data_pipelines.readers import load_corpus
    from data_pipelines.san import corpus_table

    job = _generate_san_job()
    frame = pd.DataFrame({"text": ["A man sits on a bench.", "Too short.", "A dog runs in the park."],
                          "negative": [None, None, "A cat sleeps in the house."],
                          "guard": ["unchanged", "too_short", None], "overlap": [float("nan")] * 2 + [0.5],
                          "changes": ["{}"] * 3})
    shards = ray.data.from_pandas([frame[:2], frame[2:]]).map_batches(corpus_table, batch_format="pandas")
    job.write_corpus(shards, tmp_path / "data", output_format)  # the first shard's negatives all null
    assert len(list((tmp_path / "data").iterdir())) == 2
    ds, report = load_corpus("sentences", tmp_path / "data")
    assert report.rows_written == 3 and report.rows_quarantined == 0
    rows = {r["text"]: r["negative"] for r in ds.take_all()}
    assert rows == {"A man sits on a bench.": None, "Too short.": None,
                    "A dog runs in the park.": "A cat sleeps in the house."}


def test_the_corpus_reaches_the_actors_in_a_few_blocks_each_bounded_in_rows():
    """About 8 blocks an actor, each of batch_rows to 50,000 sentences: 100M rows are 2,000 blocks, not 390k of
    256 rows (one Ray object and task each)."""
    job = _generate_san_job()
    assert job.san_blocks(32, 2, 256) == 2  # a tiny corpus: a block per actor
    assert job.san_blocks(20_000, 2, 256) == 16
    assert job.san_blocks(100_000_000, 2, 256) == 2_000 == job.san_blocks(100_000_000, 64, 256)
    assert job.san_blocks(5_000_000, 64, 256) == 512  # 8 an actor, 9,766 rows each
