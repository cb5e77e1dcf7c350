"""The embed job: its vectors equal sentence-transformers' encode_document of the same texts, its ids and text hashes
name the rows, a rerun skips the shards already written and refuses another model's settings, and a BEIR corpus on
object storage embeds into object storage with its bad rows set aside."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import job_module, private_stores


def _shards(folder: Path) -> dict[str, dict]:
    """Every Parquet shard's rows: {id: (text_hash, embedding)}, with the shard's .npy checked against it."""
    import pyarrow.parquet as pq

    rows = {}
    for shard in sorted((folder / "data").glob("*.parquet")):
        table = pq.read_table(shard)
        emb = np.stack(table["embedding"].to_numpy(zero_copy_only=False)) if table.num_rows else np.zeros((0, 0))
        assert np.array_equal(np.load(folder / "npy" / f"{shard.stem}.npy"), emb.astype(np.float32))
        for i, h, e in zip(table["id"].to_pylist(), table["text_hash"].to_pylist(), emb):
            rows[i] = (h, e)
    return rows


def test_a_corpus_embeds_as_encode_document_and_a_rerun_skips_what_is_written(ray_local, tmp_path, monkeypatch):
    """Three files (txt with a blank line, JSON lines in a subfolder, a copy of the txt) are three shards; each row's
    id is <file>:<line>, its hash the text's, its vector sentence-transformers' encode_document (the model's document
    prompt). A rerun after losing one shard writes that one alone, the same; a file changed since has its old shard
    removed; other settings or another corpus into the folder are refused by name.
    About 35 s: the job runs three times (first, after a lost shard, after a changed file), each run starting its
    actor pool."""
    from sentence_transformers import SentenceTransformer

    from encoders.backbone import build_encoder, export_encoder
    from encoders.sources import resolve_model_source

    private_stores(monkeypatch, tmp_path)
    model = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32,
                                         prompts={"query": "query: ", "document": "passage: "}), tmp_path / "model")
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    txt = ["a dog runs in the park", "", "two children play music on the beach", "the market opens at dawn"]
    (corpus / "a.txt").write_text("\n".join(txt) + "\n")
    jsonl = ["a violin in the snow", "rain over the harbor at night", "an engine", "bread and silver"]
    (corpus / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in jsonl))
    (corpus / "sub" / "copy.txt").write_text((corpus / "a.txt").read_text())  # the same bytes: a shard of its own
    job = job_module("embed")
    out = tmp_path / "embeddings"
    cfg = job.EmbedJobConfig(model={"source": str(model)}, data={"train": str(corpus)}, output_dir=str(out),
                             cpus_per_actor=0.5, embed={"batch_size": 3}, tracking={"experiment": "raoe-test"})
    first = job.main(cfg)

    texts = {"a.txt:1": txt[0], "a.txt:3": txt[2], "a.txt:4": txt[3],
             **{f"sub/b.jsonl:{i + 1}": t for i, t in enumerate(jsonl)},
             "sub/copy.txt:1": txt[0], "sub/copy.txt:3": txt[2], "sub/copy.txt:4": txt[3]}
    rows = _shards(out)
    assert set(rows) == set(texts)
    reference = SentenceTransformer(str(model), device="cpu").encode_document(list(texts.values()))
    plain = SentenceTransformer(str(model), device="cpu").encode(list(texts.values()))
    assert not np.allclose(reference, plain, atol=1e-3)  # the document prompt changes the vectors here
    for (row_id, text), expected in zip(texts.items(), reference):
        assert rows[row_id][0] == hashlib.sha1(text.encode()).hexdigest()[:16]
        np.testing.assert_allclose(rows[row_id][1], expected, rtol=1e-4, atol=1e-5)
    assert first["shards"] == first["shards_written"] == 3 and first["shards_skipped"] == 0
    assert first["rows_written"] == first["rows_total"] == len(texts) and first["dim"] == reference.shape[1]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["a.txt", "sub/b.jsonl", "sub/copy.txt"]
    assert manifest["rows"] == len(texts)

    *kept, lost = sorted((out / "data").glob("*.parquet"), key=lambda p: pq_rows(p))  # the txt: 3 rows, b.jsonl: 4
    stamps = [k.stat().st_mtime_ns for k in kept]
    lost.unlink()  # as if the job had been killed while writing it
    again = job.main(cfg)
    assert again["shards_skipped"] == 2 and again["shards_written"] == 1 and again["rows_written"] == len(jsonl)
    assert again["rows_total"] == len(texts) and [k.stat().st_mtime_ns for k in kept] == stamps
    for row_id, (digest, vector) in _shards(out).items():
        assert digest == rows[row_id][0] and np.allclose(vector, rows[row_id][1], atol=1e-6)

    (corpus / "sub" / "copy.txt").write_text("a new line\n")  # changed since: its old shard goes
    changed = job.main(cfg)
    assert changed["shards_written"] == 1 and changed["stale_shards_removed"] == 1 and changed["rows_total"] == 8
    assert len(list((out / "data").glob("*.parquet"))) == len(list((out / "npy").glob("*.npy"))) == 3
    assert set(_shards(out)) == set(texts) - {"sub/copy.txt:3", "sub/copy.txt:4"}

    with pytest.raises(ValueError, match="normalize: False there, True now"):
        job.main(cfg.model_copy(update={"embed": cfg.embed.model_copy(update={"normalize": True})}))
    with pytest.raises(ValueError, match="data: .* there"):
        job.main(cfg.model_copy(update={"data": cfg.data.model_copy(update={"train": str(corpus / "sub")})}))

    # an export as the runtime (embed.runtime; encoded in the next test) never mixes its vectors with these
    with pytest.raises(ValueError, match="runtime: None there, 'openvino' now"):
        job.main(cfg.model_copy(update={"embed": cfg.embed.model_copy(update={"runtime": "openvino"})}))
    with pytest.raises(ValueError, match="embed.runtime=onnx runs on CPU"):
        job.EmbedJobConfig(**{**cfg.model_dump(), "gpus_per_actor": 1, "embed": {"runtime": "onnx"}})


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def test_a_beir_corpus_on_object_storage_embeds_by_its_ids_and_sets_bad_rows_aside(ray_local, tmp_path, monkeypatch,
                                                                                     s3):
    """A BEIR folder's corpus.jsonl read from and written to S3: ids are the documents' _id, texts "title text"; a row
    without _id goes to quarantine/ (on_bad_record: quarantine), or stops the job naming its line (fail). The actors
    encode with an export of the model (embed.runtime: OpenVINO, built once into the cache): encode_document's
    vectors all the same, and a folder of them takes no torch-made vectors. About 40 s here: the model is exported to
    OpenVINO once and the job runs three times (one whole run with its actor pool, two refused)."""
    from encoders.backbone import load_encoder
    from encoders.sources import resolve_model_source
    from storage.paths import storage_path

    private_stores(monkeypatch, tmp_path)
    docs = [{"_id": "d7", "title": "Harbor", "text": "boats at night"}, {"_id": "d2", "text": "a violin"},
            {"title": "no id here", "text": "x"}, {"_id": "d9", "title": "", "text": "bread"}]
    beir = tmp_path / "beir"
    beir.mkdir()
    (beir / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (beir / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "boats"}) + "\n")
    source = s3.upload(beir, "beir")
    job = job_module("embed")
    cfg = job.EmbedJobConfig(model={"source": "tiny:bert"}, data={"train": source, "on_bad_record": "quarantine"},
                             output_dir=s3.uri("embedded"), cpus_per_actor=0.5, embed={"runtime": "openvino"},
                             tracking={"experiment": "raoe-test"})
    result = job.main(cfg)
    assert result["rows_total"] == 3 and result["rows_quarantined"] == 1 and result["output_dir"] == s3.uri("embedded")
    local = tmp_path / "copy"
    for name in ("manifest.json", "spec.json"):
        assert storage_path(s3.uri(f"embedded/{name}")).exists()
    shard = json.loads(storage_path(s3.uri("embedded/manifest.json")).read_text())["shards"][0]["shard"]
    for part, ext in (("data", "parquet"), ("npy", "npy")):
        (local / part).mkdir(parents=True)
        (local / part / f"{shard}.{ext}").write_bytes(storage_path(s3.uri(f"embedded/{part}/{shard}.{ext}")).read_bytes())
    rows = _shards(local)
    expected = {"d7": "Harbor boats at night", "d2": "a violin", "d9": "bread"}
    assert {i: h for i, (h, _) in rows.items()} == {i: hashlib.sha1(t.encode()).hexdigest()[:16]
                                                   for i, t in expected.items()}
    reference = load_encoder(resolve_model_source("tiny:bert")).encode_document(list(expected.values()))
    for row_id, vector in zip(expected, reference):
        np.testing.assert_allclose(rows[row_id][1], vector, rtol=1e-4, atol=1e-5)
    quarantined = storage_path(s3.uri(f"embedded/quarantine/{shard}.jsonl")).read_text().splitlines()
    assert len(quarantined) == 1 and json.loads(quarantined[0])["line"] == 3
    torch_made = cfg.model_copy(update={"embed": cfg.embed.model_copy(update={"runtime": "torch"})})
    with pytest.raises(ValueError, match="runtime: 'openvino' there, None now"):
        job.main(torch_made)

    failing = torch_made.model_copy(update={"data": cfg.data.model_copy(update={"on_bad_record": "fail"}),
                                            "output_dir": s3.uri("embedded-fail")})
    with pytest.raises(Exception, match="at line 3: a corpus row needs _id"):
        job.main(failing)
