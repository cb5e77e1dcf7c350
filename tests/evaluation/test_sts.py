"""The STS suite: SentEval layouts, Spearman x100, the "all" pooling of a year's subsets, absent tasks."""

import numpy as np
import pytest
from scipy.stats import spearmanr

from evaluation.sts import evaluate_sts, load_task, stsb_dev_spearman

# Subset A: cosine rises with gold (Spearman +100); subset B: it falls (-100). The mean of the subsets is 0,
# but pooling both before one Spearman gives another number: the "all" setting must pool.
A = ([0.10, 0.20, 0.30, 0.40], [1.0, 2.0, 3.0, 4.0])
B = ([0.50, 0.60, 0.70, 0.80], [5.0, 4.8, 4.6, 4.4])


def _vector(cos: float) -> list[float]:
    return [cos, float(np.sqrt(1 - cos**2))]


@pytest.fixture
def senteval(tmp_path):
    """A SentEval-layout root with STS12 (two subsets, one empty gold line) and STS-B dev; other tasks absent."""
    table = {}
    year = tmp_path / "STS" / "STS12-en-test"
    year.mkdir(parents=True)
    for name, (cosines, gold) in {"MSRpar": A, "MSRvid": B}.items():
        lines, scores = [], []
        for i, (c, g) in enumerate(zip(cosines, gold)):
            s1, s2 = f"{name} left {i}", f"{name} right {i}"
            table[s1], table[s2] = [1.0, 0.0], _vector(c)
            lines.append(f"{s1}\t{s2}")
            scores.append(f"{g}")
        lines.append("unscored left\tunscored right")  # SentEval: an empty gold line means "not scored"
        scores.append("")
        (year / f"STS.input.{name}.txt").write_text("\n".join(lines) + "\n")
        (year / f"STS.gs.{name}.txt").write_text("\n".join(scores) + "\n")
    stsb = tmp_path / "STS" / "STSBenchmark"
    stsb.mkdir(parents=True)
    rows = []
    for i, (c, g) in enumerate(zip(*A)):
        s1, s2 = f"dev left {i}", f"dev right {i}"
        table[s1], table[s2] = [1.0, 0.0], _vector(c)
        rows.append(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{g}\t{s1}\t{s2}")
    (stsb / "sts-dev.csv").write_text("\n".join(rows) + "\n")

    def encode(sentences):
        missing = [s for s in sentences if s not in table]
        assert not missing, f"the suite encoded sentences without gold scores: {missing}"
        return np.array([table[s] for s in sentences])

    return tmp_path, encode


def test_pooled_year_score_is_not_the_mean_of_its_subsets(senteval):
    root, encode = senteval
    result = evaluate_sts(encode, root, ["STS12"])
    pooled = spearmanr(A[0] + B[0], A[1] + B[1]).statistic * 100
    assert result["STS12"] == pytest.approx(pooled)
    assert abs(result["STS12"] - 0.0) > 10  # the mean of +100 and -100 would be 0


def test_known_values_and_absent_tasks(senteval):
    root, encode = senteval
    result = evaluate_sts(encode, root, ["STS12", "STS13", "STSBenchmark", "SICKRelatedness"], stsb_split="dev")
    assert result["STSBenchmark"] == pytest.approx(100.0)
    assert result["STS13"] is None and result["SICKRelatedness"] is None  # absent, not zero
    assert result["avg"] == pytest.approx((result["STS12"] + 100.0) / 2)  # average of the present tasks only
    assert stsb_dev_spearman(encode, root) == pytest.approx(100.0)  # training's selection uses the same path


def test_one_encoding_pass_of_the_suite_sentences_serves_every_task(senteval, monkeypatch):
    """The evaluate and promote jobs encode the suite's sentences in one Ray Data pass (one actor pool, one model
    load), not one per task; every task then reads its embeddings from that pass, and the scores are unchanged."""
    from types import SimpleNamespace

    from evaluation import encode as encode_module

    root, encode = senteval
    passes = []

    def one_pass(model_path, sentences, *, batch_size, pool, side=None):
        passes.append(list(sentences))
        return encode(sentences)

    monkeypatch.setattr(encode_module, "ray_encode", one_pass)
    tasks = ["STS12", "STS13", "STSBenchmark"]
    cfg = SimpleNamespace(data_dir=root, tasks=tasks, max_pairs=3, stsb_split="dev", batch_size=8)
    scores = encode_module.score_with_ray("unused", cfg)
    suite = [load_task(root, t, split="dev") for t in tasks]
    wanted = sorted({s for pairs in suite if pairs for s in (*pairs.head(3).sentences1, *pairs.head(3).sentences2)})
    assert len(passes) == 1 and sorted(passes[0]) == wanted
    assert len(passes[0]) == 2 * (3 + 3)  # the first 3 pairs of STS12 (its subsets pooled) and of STS-B dev
    assert scores == evaluate_sts(encode, root, tasks, max_pairs=3, stsb_split="dev")


def test_eval_dims_cut_the_same_encodings_to_their_leading_dimensions(senteval, monkeypatch):
    """eval.dims: the suite at the leading d dimensions of the embeddings it encoded once (the cache), renormalised:
    here a third dimension added to the fixture's 2-d embeddings is cut away again, giving the 2-d scores."""
    from types import SimpleNamespace

    from evaluation import encode as encode_module

    root, encode = senteval
    passes = []

    def with_a_third_dimension(model_path, sentences, *, batch_size, pool, side=None):
        passes.append(len(sentences))
        extra = np.array([[(hash(s) % 7) / 3.0] for s in sentences])
        return np.hstack([encode(sentences), extra])

    monkeypatch.setattr(encode_module, "ray_encode", with_a_third_dimension)
    cfg = SimpleNamespace(data_dir=root, tasks=["STS12", "STSBenchmark"], max_pairs=None, stsb_split="dev",
                          batch_size=8)
    encodings, whole_cosines, cut_cosines, want_cosines = encode_module.Encodings("unused", 8), {}, {}, {}
    encode_module.score_with_ray("unused", cfg, encodings=encodings, predictions=whole_cosines)
    cut = encode_module.score_with_ray("unused", cfg, encodings=encodings, dim=2, predictions=cut_cosines)
    assert len(passes) == 1  # the cut reads the encodings
    assert cut == evaluate_sts(encode, root, cfg.tasks, stsb_split="dev", predictions=want_cosines)
    np.testing.assert_allclose(cut_cosines["STSBenchmark"][0], want_cosines["STSBenchmark"][0], rtol=1e-5)
    assert not np.allclose(whole_cosines["STSBenchmark"][0], want_cosines["STSBenchmark"][0], atol=1e-3)


def test_student_scores_equal_a_direct_sentence_transformers_computation(dev_data):
    """The MiniLM student (a real model: 63 sentences/s here) on the first pairs of each task, both ways."""
    PAIRS = 100  # noqa: N806 - enough pairs for Spearman to see a wrong sentence or pair order; 300 took 40 s
    from sentence_transformers import SentenceTransformer

    from encoders.backbone import inference_embeddings, load_encoder
    from encoders.sources import resolve_model_source
    from evaluation.sts import load_task

    path = resolve_model_source("pypi:all-minilm-l6-v2")
    model = load_encoder(path)
    suite = evaluate_sts(lambda s: inference_embeddings(model, s, 64), dev_data / "senteval", ["STS12", "STSBenchmark"],
                         max_pairs=PAIRS, stsb_split="dev")
    direct_model = SentenceTransformer(path, device="cpu")
    for task in ("STS12", "STSBenchmark"):
        pairs = load_task(dev_data / "senteval", task, split="dev").head(PAIRS)
        a = direct_model.encode(pairs.sentences1, normalize_embeddings=True)
        b = direct_model.encode(pairs.sentences2, normalize_embeddings=True)
        direct = spearmanr((a * b).sum(1), pairs.gold).statistic * 100
        assert suite[task] == pytest.approx(direct, abs=0.01), task
