"""The principal-axes rotation: its axes are scikit-learn's PCA of the unit-length embeddings, fit in pieces as at
once; inserted after a projection head or before a final Normalize it changes no whole-embedding cosine and makes
the rotated embeddings' covariance diagonal, most variance first; training keeps it (build_encoder) and refuses LoRA
or quantisation on it; the rotate job fits it from embed output folders (local and on object storage), records the
cut sizes asked for, and refuses by name what it would get wrong."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import job_module, private_stores

TEXTS = [f"{a} {b} near the {c}" for a in ("a dog", "two children", "the old man", "a violinist", "rain", "bread")
         for b in ("runs", "sleeps", "plays music", "waits", "falls") for c in ("park", "harbor", "market", "beach")]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return a @ b.T


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_the_axes_are_the_principal_components_of_the_unit_embeddings_fit_in_pieces():
    from sklearn.decomposition import PCA

    from encoders.rotation import PrincipalAxes, orthogonality_error, share_kept

    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.normal(size=(12, 12)))
    data = (rng.normal(size=(600, 12)) * np.geomspace(4.0, 0.2, 12)) @ basis.T + 3.0 * basis[:, 5]  # off-centre
    axes = PrincipalAxes(12)
    for part in np.array_split(data, 4):
        axes.add(part)
    weight, variances = axes.rotation()
    reference = PCA(n_components=12).fit(_unit(data))
    np.testing.assert_allclose(np.abs(weight @ reference.components_.T), np.eye(12), atol=1e-6)  # same axes, +-
    np.testing.assert_allclose(variances, reference.explained_variance_ * 599 / 600, rtol=1e-6, atol=1e-12)
    assert (weight[np.arange(12), np.abs(weight).argmax(axis=1)] > 0).all()  # signed: the same data, the same matrix
    assert orthogonality_error(weight) < 1e-6
    kept = share_kept(variances, [1, 3, 12])
    np.testing.assert_allclose([kept[1], kept[3]], np.cumsum(reference.explained_variance_ratio_)[[0, 2]], rtol=1e-6)
    assert kept[12] == pytest.approx(1.0) and kept[3] > share_kept(axes.variances(), [3])[3] + 0.1
    with pytest.raises(ValueError, match="needs more than 12 embeddings, got 12"):
        few = PrincipalAxes(12)
        few.add(data[:12])
        few.rotation()


def test_a_rotated_model_keeps_its_cosines_and_trains_with_its_rotation(tmp_path):
    """On a model with a projection head (Dense 32 -> 16, tanh), the rotation goes after the head and rotates each
    embedding (e @ W.T); whole-embedding cosines stay; the exported folder built for training (build_encoder) keeps
    both Dense modules in order, computes the same, and the rotation has a gradient; LoRA or quantisation on it is
    refused by name, before any weight loads. On a model ending in Normalize the rotation goes before it: unit
    length and every cosine stay."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Dense

    from encoders.backbone import build_encoder, export_encoder, forward_pass, inference_embeddings, load_encoder
    from encoders.model_files import refuse_adapters_on_heads
    from encoders.rotation import PrincipalAxes, with_rotation
    from encoders.sources import resolve_model_source

    model = build_encoder(resolve_model_source("tiny:bert"), max_length=32, prompts={"query": "query: "})
    torch.manual_seed(0)
    model.append(Dense(32, 16, activation_function=torch.nn.Tanh()))
    plain = inference_embeddings(model, TEXTS)
    axes = PrincipalAxes(plain.shape[1])
    axes.add(plain)
    weight, _ = axes.rotation()
    with_rotation(model, weight)
    rotated = inference_embeddings(model, TEXTS)
    np.testing.assert_allclose(rotated, plain @ weight.T, atol=1e-5)
    np.testing.assert_allclose(_cosines(rotated, rotated), _cosines(plain, plain), atol=1e-5)
    centred = _unit(rotated) - _unit(rotated).mean(axis=0)
    cov = centred.T @ centred / len(TEXTS)
    assert np.abs(cov - np.diag(np.diag(cov))).max() < 1e-6 * np.diag(cov).max()  # the axes are uncorrelated
    assert (np.diff(np.diag(cov)) <= 1e-9).all()  # most variance first

    folder = export_encoder(model, tmp_path / "rotated")
    trainable = build_encoder(str(folder), max_length=32, prompts={"query": "query: "})
    assert [type(m).__name__ for m in trainable] == ["Transformer", "Pooling", "Dense", "Dense"]
    assert trainable[3].linear.weight.shape == (16, 16)  # the rotation, after the head
    np.testing.assert_allclose(inference_embeddings(trainable, TEXTS, side="query"),
                               inference_embeddings(model, TEXTS, side="query"), atol=1e-6)
    np.testing.assert_allclose(inference_embeddings(load_encoder(folder), TEXTS), rotated, atol=1e-6)
    trainable.train()
    forward_pass(trainable, trainable, TEXTS[:4]).pow(2).sum().backward()
    assert trainable[3].linear.weight.grad is not None and trainable[3].linear.weight.grad.abs().sum() > 0
    assert trainable[3].linear.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="model.lora / model.quantization: .*Dense module after pooling"):
        build_encoder(str(folder), lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"})
    with pytest.raises(ValueError, match="model.lora / model.quantization: .*Dense module after pooling"):
        refuse_adapters_on_heads(str(folder), lora=False, quantization="nf4")  # as the driver checks, before Ray
    refuse_adapters_on_heads(str(folder), lora=False, quantization="none")  # a full fine-tune of it is fine

    from sentence_transformers.sentence_transformer.modules import Normalize

    normalised = build_encoder(resolve_model_source("tiny:bert"), max_length=32)
    normalised.append(Normalize())
    before = inference_embeddings(normalised, TEXTS)
    with_rotation(normalised, np.linalg.qr(np.random.default_rng(1).normal(size=(32, 32)))[0])
    assert [type(m).__name__ for m in normalised] == ["Transformer", "Pooling", "Dense", "Normalize"]
    after = inference_embeddings(normalised, TEXTS)
    np.testing.assert_allclose(np.linalg.norm(after, axis=1), 1.0, atol=1e-5)  # still unit length, and
    np.testing.assert_allclose(after @ after.T, before @ before.T, atol=1e-5)  # the same cosines


def _embed_folder(place: str, model: Path, texts: list[str], shards: int, vectors_of: Path | None = None) -> None:
    """An embed job's output folder (spec, shards, manifest) of ``model``'s vectors of ``texts``, as embed.py writes
    (the vectors of ``vectors_of`` where given: a model this CPU cannot load)."""
    from data_pipelines.embedding import MANIFEST, SPEC, SPEC_VERSION, text_hashes, write_shard
    from encoders.backbone import inference_embeddings, load_encoder
    from evaluation.corpus_index import model_fingerprint
    from storage.paths import join, write_whole

    vectors = inference_embeddings(load_encoder(vectors_of or model), texts)
    write_whole(join(place, SPEC), json.dumps({"version": SPEC_VERSION, "data": "texts", "model": str(model),
                                               "model_fingerprint": model_fingerprint(str(model)), "side": None,
                                               "normalize": False, "format": "txt"}))
    listed = []
    for n, rows in enumerate(np.array_split(np.arange(len(texts)), shards)):
        name = f"shard{n}"
        write_shard(place, name, [str(i) for i in rows], text_hashes([texts[i] for i in rows]), vectors[rows])
        listed.append({"shard": name, "file": "texts", "rows": len(rows)})
    write_whole(join(place, MANIFEST), json.dumps({"shards": listed, "rows": len(texts), "dim": vectors.shape[1]}))


def test_the_rotate_job_fits_embed_folders_on_object_storage_and_refuses_another_models(tmp_path, monkeypatch, s3):
    """Two embed folders (one local, one on object storage) of one model: the rotated model written to object
    storage embeds every text as the source's vectors rotated onto the principal axes of both folders' rows; the
    JSON line reports the variance a cut keeps before and after. The sizes asked for are recorded as the rotated
    model's (serving's dimensions), the source's Matryoshka sizes dropped. Refused, naming the folder, key or model:
    a folder of another model, an unfinished one, too few rows for the width, cut sizes wider than the model, a
    model changed since it was embedded, a LoRA adapter, a quantised model and an RSE model."""
    from encoders.backbone import build_encoder, export_encoder, inference_embeddings, load_encoder
    from encoders.rotation import PrincipalAxes
    from encoders.sources import resolve_model_source
    from storage.paths import local_copy

    private_stores(monkeypatch, tmp_path)
    tiny = resolve_model_source("tiny:bert")
    model = export_encoder(build_encoder(tiny, max_length=32), tmp_path / "model", {"matryoshka_dims": [24]})
    half = len(TEXTS) // 2
    _embed_folder(str(tmp_path / "emb-a"), model, TEXTS[:half], shards=2)
    _embed_folder(s3.uri("emb-b"), model, TEXTS[half:], shards=3)
    job = job_module("rotate")
    cfg = job.RotateJobConfig(rotate={"embeddings": [str(tmp_path / "emb-a"), s3.uri("emb-b")], "dims": [8, 16]},
                              output_dir=s3.uri("rotated"), tracking={"experiment": "raoe-test"})
    result = job.main(cfg)

    source = inference_embeddings(load_encoder(model), TEXTS)
    axes = PrincipalAxes(source.shape[1])
    axes.add(source)
    weight, _ = axes.rotation()
    assert result["rows"] == len(TEXTS) and result["dim"] == source.shape[1] == 32
    assert result["model_path"] == s3.uri("rotated/model") and result["orthogonality_error"] < 1e-5
    with local_copy(result["model_path"]) as folder:
        rotated = inference_embeddings(load_encoder(folder), TEXTS)
        meta = json.loads((Path(folder) / "raoe_encoder.json").read_text())
    np.testing.assert_allclose(rotated, source @ weight.T, atol=1e-5)
    assert meta["rotation"]["rows"] == len(TEXTS)
    assert meta["matryoshka_dims"] == [16, 8]  # the sizes asked for (serving's dimensions), not the source's 24
    assert list(result["variance_kept"]) == [8, 16, 32] and result["variance_kept"][32] == pytest.approx(1.0)
    assert result["variance_kept"][8] > result["variance_kept_before"][8] + 0.2

    other = export_encoder(build_encoder(tiny, max_length=32, pooling="cls"), tmp_path / "other")
    _embed_folder(str(tmp_path / "emb-other"), other, TEXTS[:40], shards=1)
    with pytest.raises(ValueError, match="vectors of different models.*emb-other"):
        job.main(job.RotateJobConfig(rotate={"embeddings": [str(tmp_path / "emb-a"), str(tmp_path / "emb-other")]},
                                     output_dir=str(tmp_path / "out")))
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(FileNotFoundError, match="unfinished holds no finished embeddings"):
        job.main(job.RotateJobConfig(rotate={"embeddings": [str(tmp_path / "unfinished")]},
                                     output_dir=str(tmp_path / "out")))
    with pytest.raises(ValueError, match=r"rotate.dims \[64\]: the model's embedding has 32 dimensions"):
        job.main(job.RotateJobConfig(rotate={"embeddings": [str(tmp_path / "emb-a")], "dims": [16, 64]},
                                     output_dir=str(tmp_path / "out")))
    with pytest.raises(ValueError, match=r"hold 20 embeddings \(rotate.max_rows=20\).*dimensions \(32\)"):
        job.main(job.RotateJobConfig(rotate={"embeddings": [str(tmp_path / "emb-a")], "max_rows": 20},
                                     output_dir=str(tmp_path / "out")))
    def write(name: str, text: str):
        return lambda folder: (folder / name).write_text(text)

    cases = [  # (what is refused, a change to the model folder before it is embedded, and one after)
        ("another version of", None, write("raoe_encoder.json", "{}")),
        ("a LoRA adapter or a quantised model", write("raoe_encoder.json", json.dumps({"quantization": "nf4"})), None),
        ("a LoRA adapter or a quantised model", write("adapter_config.json",
                                                      json.dumps({"base_model_name_or_path": tiny})), None),
        ("a relational \\(RSE\\) model", write("relations.json", json.dumps({"relations": ["entailment"]})), None),
    ]
    for n, (reason, before_embedding, after_embedding) in enumerate(cases):
        changed = export_encoder(build_encoder(tiny, max_length=32), tmp_path / f"changed{n}")
        if before_embedding:
            before_embedding(changed)
        _embed_folder(str(tmp_path / f"emb-changed{n}"), changed, TEXTS[:40], shards=1, vectors_of=model)
        if after_embedding:
            after_embedding(changed)
        with pytest.raises(ValueError, match=reason):
            job.main(job.RotateJobConfig(rotate={"embeddings": [str(tmp_path / f"emb-changed{n}")]},
                                         output_dir=str(tmp_path / "out")))
