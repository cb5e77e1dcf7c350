"""SAN negatives: POS-importance masking rates, static vs dynamic tagging, fill only masked words with the anchor's
casing, reproducible seeds, the guard, LLM output parsing, and every input row accounted for by the job."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_pipelines.san import (
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


def test_job_accounts_for_every_input_row(ray_local, tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        from generate_san import GenerateSanJobConfig, main
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))
    corpus = tmp_path / "wiki.txt"
    corpus.write_bytes("\n".join(SENTENCES[:30]).encode() + b"\n?!\n\xff broken line\nToo short.\n...\nOk then it is.\n")
    cfg = GenerateSanJobConfig(data={"train": str(corpus), "on_bad_record": "quarantine"},
                               san={"model": "tiny:bert-mlm", "iterations": 2, "cpus_per_actor": 0.5},
                               output_dir=str(tmp_path / "san"), tracking={"experiment": "raoe-test"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("RAOE_MLFLOW_ARTIFACTS", str(tmp_path / "artifacts"))
    result = main(cfg)
    assert result["rows_in"] == 35 and result["rows_quarantined"] == 3  # '?!', bad UTF-8, '...'
    assert result["rows_written"] + result["rows_guarded"] + result["rows_quarantined"] == result["rows_in"]
    assert result["guarded"]["too_short"] == 1  # 'Too short.' has 2 words
    guarded = [json.loads(x) for x in open(result["guarded_path"])]
    assert len(guarded) == result["rows_guarded"] and {"text", "reason"} <= set(guarded[0])
    import pandas as pd

    written = pd.read_parquet(result["output_path"])
    assert len(written) == result["rows_written"] and (written["text"] != written["negative"]).all()
    assert set(result["changed_share_by_pos"]) >= {"NOUN", "DET"} and Path(result["plot"]).exists()
