"""Exports: a QLoRA model merged into its dequantised base embeds as the 4-bit model did, in a plain folder; the ONNX
graphs run the same function with sentence-transformers' prompts and sides; the export job keeps what passes its
parity check on a registry version's run and refuses what drifts, with the figures."""

import json

import numpy as np
import pytest
import torch

from encoders.backbone import build_encoder, export_encoder, inference_embeddings, load_encoder
from encoders.export import expanding_matmuls, load_export, save_merged, save_onnx, save_openvino, trace_onnx
from encoders.sources import resolve_model_source
from evaluation.parity import cosines
from evaluation.retrieval import dev_ndcg_at_10, read_dev_set
from tests.conftest import job_module, private_stores
from tests.evaluation.test_retrieval import _random_beir
from tests.training.conftest import stsb_dev_folder

TEXTS = ["a man is playing music.", "two dogs run in the snow", "the woman is eating food in the park with a child",
         "a girl rides a bike", "rain"]


@pytest.fixture(scope="module")
def qlora_folder(tmp_path_factory):
    """A tiny causal LM, 4-bit NF4 base with LoRA adapters whose B matrices are random (a fresh adapter is a no-op),
    exported as training exports it: the adapter alone beside the base's name."""
    torch.manual_seed(0)
    model = build_encoder(resolve_model_source("tiny:qwen2"), pooling="last_token", quantization="nf4",
                          prompt="Summarize sentence {text} in one word:", padding_side="left", max_length=48,
                          lora={"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"})
    with torch.no_grad():
        for name, param in model[0].auto_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return export_encoder(model, tmp_path_factory.mktemp("qlora") / "model")


def test_a_qlora_model_merges_into_a_plain_folder_that_embeds_as_the_4bit_model(qlora_folder, tmp_path):
    from sentence_transformers import SentenceTransformer

    source = inference_embeddings(load_encoder(str(qlora_folder)), TEXTS)
    merged = save_merged(str(qlora_folder), tmp_path / "merged")
    assert not (merged / "adapter_config.json").exists() and (merged / "model.safetensors").exists()
    assert json.loads((merged / "raoe_encoder.json").read_text())["quantization"] == "none"
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    plain = SentenceTransformer(str(merged), device="cpu")  # no peft, no bitsandbytes needed to load it
    assert not any("lora" in name for name, _ in plain.named_parameters())
    got = inference_embeddings(load_encoder(str(merged)), TEXTS)
    assert cosines(source, got).min() > 0.9999
    base = inference_embeddings(build_encoder(resolve_model_source("tiny:qwen2"), pooling="last_token",
                                              prompt="Summarize sentence {text} in one word:", padding_side="left",
                                              max_length=48), TEXTS)
    assert cosines(base, got).min() < 0.99  # the adapters are in the merged weights

    half = save_merged(str(qlora_folder), tmp_path / "merged-bf16", "bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"


def test_onnx_graphs_embed_as_the_model_with_its_query_and_document_prompts(tmp_path):
    """sentence-transformers' ONNX layout (onnx/model.onnx, output last_hidden_state); encode_query and
    encode_document through onnxruntime, and through OpenVINO from the same graph, equal the torch model's, which is
    never loaded beside the graph; int8 quantises the feed-forward up-projections alone and stays close."""
    import onnx

    model = build_encoder(resolve_model_source("tiny:bert"), max_length=32, query_max_length=8,
                          prompts={"query": "query: ", "document": "passage: "})
    source = export_encoder(model, tmp_path / "source")
    merged = save_merged(str(source), tmp_path / "merged")
    fp32, int8 = save_onnx(merged, tmp_path / "onnx"), save_onnx(merged, tmp_path / "onnx_int8", int8=True)
    graph = onnx.load(str(fp32 / "onnx" / "model.onnx"))
    assert [o.name for o in graph.graph.output] == ["last_hidden_state"]
    assert {i.name for i in graph.graph.input} >= {"input_ids", "attention_mask"}
    quantised = onnx.load(str(int8 / "onnx" / "model_qint8.onnx"))
    ops = [n.op_type for n in quantised.graph.node]
    widening = expanding_matmuls(fp32 / "onnx" / "model.onnx")  # the feed-forward up-projection of each layer
    assert len(widening) == 2 and ops.count("MatMulInteger") == len(widening)
    assert ops.count("MatMul") == [n.op_type for n in graph.graph.node].count("MatMul") - len(widening)
    torch_model, onnx_model = load_encoder(str(source)), load_export(fp32, "onnx")
    # the graph runs in the transformer's place, which holds no torch weights: none were built, read or kept
    assert type(onnx_model[0].model).__name__ == "_OnnxForward" and not list(onnx_model.parameters())
    trace = trace_onnx(merged, tmp_path / "trace")  # the graph alone: no weights copied for a format not kept
    assert sorted(str(p.relative_to(trace)) for p in trace.rglob("*") if p.is_file()) == ["onnx/model.onnx"]
    from_trace = save_onnx(merged, tmp_path / "onnx-from-trace", traced=trace)  # the traced graph, not a new trace
    assert (from_trace / "onnx" / "model.onnx").read_bytes() == (trace / "onnx" / "model.onnx").read_bytes()
    openvino = save_openvino(merged, tmp_path / "openvino", traced=trace)  # the ONNX graph as OpenVINO IR, fp32
    assert {p.name for p in (openvino / "openvino").iterdir()} == {"openvino_model.xml", "openvino_model.bin"}
    assert not (openvino / "onnx").exists()
    for folder in (fp32, int8, from_trace, openvino):  # the graph holds the weights: no fp32 copy beside it
        assert (merged / "model.safetensors").exists() and not (folder / "model.safetensors").exists()
        assert (folder / "tokenizer.json").exists() and (folder / "modules.json").exists()
    for encode in ("encode_query", "encode_document"):
        want = getattr(torch_model, encode)(TEXTS)
        np.testing.assert_allclose(getattr(onnx_model, encode)(TEXTS), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(getattr(load_export(openvino, "openvino"), encode)(TEXTS), want, rtol=1e-4,
                                   atol=1e-5)
    assert cosines(torch_model.encode_query(TEXTS), torch_model.encode_document(TEXTS)).min() < 0.999  # sides differ
    assert cosines(torch_model.encode_query(TEXTS), load_export(int8, "onnx_int8").encode_query(TEXTS)).min() > 0.9


def test_the_export_job_logs_what_passes_on_the_version_and_refuses_what_drifts(tmp_path, monkeypatch, s3):
    """A registry alias as the source: merged and onnx pass and land on S3 and on the version's run (artifacts,
    tags, description); onnx_int8 under a threshold it cannot reach is refused, the job failing with its figures.
    With eval.retrieval each export's nDCG@10 is compared with the source's, computed here as training's dev check
    computes it; a delta past export.max_retrieval_delta is named as a drift."""
    import mlflow
    from mlflow import MlflowClient

    from runtime.tracking_store import ensure_experiment
    from tracking.model_registry import log_and_register

    private_stores(monkeypatch, tmp_path)
    folder = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32), tmp_path / "model")
    experiment = ensure_experiment("raoe-test")  # MLflow here on the test's store (never a global experiment)
    with mlflow.start_run(experiment_id=experiment) as run:
        version = log_and_register(folder, run.info.run_id, "raoe-export-test")["version"]
    client = MlflowClient()
    client.set_registered_model_alias("raoe-export-test", "champion", str(version))
    job = job_module("export")
    cfg = job.ExportJobConfig(model={"source": "models:/raoe-export-test@champion"},
                              export={"formats": ["merged", "onnx_int8", "onnx", "openvino"], "sample_pairs": 24,
                                      "min_cosine_int8": 1.0},
                              eval={"data_dir": str(stsb_dev_folder(tmp_path / "senteval"))}, output_dir=s3.uri("exports"))
    import encoders.export

    traces, trace = [], encoders.export._export_graph
    monkeypatch.setattr(encoders.export, "_export_graph", lambda *a: traces.append(a) or trace(*a))
    with pytest.raises(job.ExportRefused,
                       match=r"onnx_int8: min cosine [01]\.\d+ \(needs 1\.0\).*Kept: merged, onnx, openvino"):
        job.main(cfg)
    assert len(traces) == 1  # onnx_int8 (asked first), onnx and openvino took one trace: the model traced once
    from storage.paths import storage_path

    assert storage_path(s3.uri("exports/onnx/onnx/model.onnx")).exists()
    assert not storage_path(s3.uri("exports/onnx_int8")).exists()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "exports")}
    assert artifacts == {"exports/merged", "exports/onnx", "exports/openvino"}
    held = client.get_model_version("raoe-export-test", str(version))
    assert float(held.tags["export.onnx.min_cosine"]) > 0.9999 and "export.onnx_int8.min_cosine" not in held.tags
    assert float(held.tags["export.openvino.min_cosine"]) > 0.9999  # fp32: the fp32 threshold
    assert "## Exports" in held.description and "| onnx |" in held.description

    # eval.retrieval: a BEIR folder whose nDCG@10 each export keeps (the merged fp32 weights are the source's own; a
    # dozen queries of a random model move by whole points at one swapped rank, hence the wide bound here)
    beir = _random_beir(tmp_path, np.random.default_rng(2))[0]
    loose = {"min_cosine_int8": 0.5, "max_retrieval_delta": 50.0}
    task = job.RetrievalTaskConfig(source=str(beir))
    passing = job.main(cfg.model_copy(update={"export": cfg.export.model_copy(update=loose),
                                              "eval": cfg.eval.model_copy(update={"retrieval": task})}))
    assert set(passing["exports"]) == {"merged", "onnx", "onnx_int8", "openvino"}
    assert sorted(p.name for p in storage_path(passing["exports"]["onnx_int8"]["path"]).joinpath("onnx").iterdir()) \
        == ["model_qint8.onnx"]  # the int8 graph alone, not the fp32 graph it was quantised from
    for figures in passing["exports"].values():
        assert {"path", "min_cosine", "mean_cosine", "score_delta", "texts_per_s", "retrieval_delta"} <= set(figures)
        assert figures["texts_per_s"] > 0 and abs(figures["score_delta"]) <= 0.5
        assert abs(figures["retrieval_delta"]) <= 50.0
    dev = read_dev_set(str(beir), "test")
    source = load_encoder(folder)
    expected = dev_ndcg_at_10(lambda texts, side: inference_embeddings(source, texts, 32, side), dev)
    assert passing["source_retrieval_score"] == pytest.approx(expected) and 0 < expected < 100
    assert passing["exports"]["merged"]["retrieval_delta"] == pytest.approx(0.0, abs=1e-9)
    assert passing["model_version"] == f"models:/raoe-export-test/{version}"
    held = client.get_model_version("raoe-export-test", str(version))
    assert held.description.count("## Exports") == 1 and "nDCG@10 delta" in held.description
    assert "export.onnx.retrieval_delta" in held.tags
    thresholds = job.ExportSection(max_retrieval_delta=0.25)
    assert job.drift({"min_cosine": 1.0, "min_cosine_required": 0.99, "score_delta": 0.1, "retrieval_delta": -0.3},
                     thresholds) == ["nDCG@10 delta -0.300 (at most 0.25)"]
    assert job.drift({"min_cosine": 1.0, "min_cosine_required": 0.99, "score_delta": 0.1}, thresholds) == []

    client.update_model_version("raoe-export-test", str(version), description=client.get_model_version(
        "raoe-export-test", str(version)).description + "\n\n## Notes\n\nkept by hand")
    with pytest.raises(job.ExportRefused):  # int8 refused again: its earlier export and figures do not stay
        job.main(cfg)
    held = client.get_model_version("raoe-export-test", str(version))
    assert not storage_path(s3.uri("exports/onnx_int8")).exists() and "export.onnx_int8.min_cosine" not in held.tags
    assert held.description.count("## Exports") == 1 and "| onnx_int8 |" not in held.description
    assert held.description.endswith("## Notes\n\nkept by hand")


def test_an_int8_export_of_a_graph_past_2_gb_keeps_its_weights_in_one_file_beside_it(tmp_path, monkeypatch):
    """Past protobuf's 2 GB (a 7B decoder) torch's exporter writes a file per weight beside the graph, and the
    quantised graph cannot be written inside one file either: it keeps its weights in one file beside it, the fp32
    weight files are gone, and it embeds as the int8 export of the same model kept whole."""
    import onnx

    import encoders.export as export

    source = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32), tmp_path / "source")
    merged = save_merged(str(source), tmp_path / "merged")
    whole = save_onnx(merged, tmp_path / "whole", int8=True)
    real = export._export_graph

    def past_2_gb(folder, target):  # what torch's exporter writes for a graph over 2 GB
        real(folder, target)
        onnx.save_model(onnx.load(str(target)), str(target), save_as_external_data=True, all_tensors_to_one_file=False,
                        size_threshold=0)

    monkeypatch.setattr(export, "_export_graph", past_2_gb)
    split = save_onnx(merged, tmp_path / "split", int8=True)
    files = sorted(p.name for p in (split / "onnx").iterdir())
    assert files == ["model_qint8.onnx", "model_qint8.onnx.data"]
    assert export.weight_files(split / "onnx" / "model_qint8.onnx") == ["model_qint8.onnx.data"]
    assert not export.weight_files(whole / "onnx" / "model_qint8.onnx")
    np.testing.assert_allclose(load_export(split, "onnx_int8").encode(TEXTS), load_export(whole, "onnx_int8").encode(TEXTS),
                               rtol=1e-5, atol=1e-6)


def test_the_openvino_format_is_refused_by_name_where_the_package_is_not_installed(monkeypatch):
    """openvino is not a dependency of raoe: asking for it where it is not installed fails the config, before any
    work, with the key and the install line (the export job's formats, the serving job's format, the embed job's
    runtime)."""
    import importlib.util

    from pydantic import ValidationError

    find_spec = importlib.util.find_spec
    for job, config, section, key in (("export", "ExportJobConfig", {"export": {"formats": ["onnx", "openvino"]}},
                                       "export.formats"),
                                      ("serve", "ServeJobConfig", {"serve": {"format": "openvino"}}, "serve.format"),
                                      ("embed", "EmbedJobConfig", {"data": {"train": "corpus"},
                                                                   "embed": {"runtime": "openvino"}}, "embed.runtime")):
        config = getattr(job_module(job), config)
        config(**section)  # installed here
        with monkeypatch.context() as absent:
            absent.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else find_spec(name, *a))
            with pytest.raises(ValidationError, match=rf"{key}: the openvino format needs .*pip install openvino=="):
                config(**section)


def test_a_torch_model_loading_on_another_thread_during_a_graph_load_gets_its_weights(tmp_path):
    """The graph takes the transformer's place only for the thread loading the export: a Serve replica or an actor
    loading a torch model on another thread meanwhile gets its own weights, never a graph."""
    import threading

    from encoders.export import _graph_in_the_transformers_place

    source = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32), tmp_path / "source")
    want, got = load_encoder(str(source)).encode(TEXTS), {}

    def no_graph_here(config):
        raise AssertionError("a graph was built for a torch load")

    with _graph_in_the_transformers_place(no_graph_here):
        other = threading.Thread(target=lambda: got.update(emb=load_encoder(str(source)).encode(TEXTS)))
        other.start()
        other.join()
    np.testing.assert_allclose(got["emb"], want, rtol=1e-5, atol=1e-6)


def test_a_dense_head_keeps_its_weights_when_the_graph_runs_the_transformer(tmp_path):
    """A model with a Dense module after pooling (as some hub models have): its ONNX export keeps the head's weights
    (the transformer's are in the graph alone) and the graph's embeddings equal the torch model's."""
    from sentence_transformers.models import Dense

    torch.manual_seed(0)
    model = build_encoder(resolve_model_source("tiny:bert"), max_length=32)
    width = model.get_embedding_dimension()
    model.append(Dense(width, 8, activation_function=torch.nn.Tanh()))
    source = export_encoder(model, tmp_path / "source")
    onnx_folder = save_onnx(save_merged(str(source), tmp_path / "merged"), tmp_path / "onnx")
    assert not (onnx_folder / "model.safetensors").exists() and list(onnx_folder.glob("*Dense/model.safetensors"))
    want = load_encoder(str(source)).encode(TEXTS)
    assert want.shape[1] == 8
    np.testing.assert_allclose(load_export(onnx_folder, "onnx").encode(TEXTS), want, rtol=1e-4, atol=1e-5)


def test_nodes_actors_asking_for_one_export_at_once_build_it_once(tmp_path, monkeypatch):
    """Actors starting together on a node (an embed pool, serving replicas) ask for the same export: one builds it
    (one merge, one trace) while the others wait, then all load the same folder; a build that fails leaves no
    staging folder behind."""
    import threading

    import encoders.export as export
    from encoders.cache import building

    monkeypatch.setenv("RAOE_CACHE", str(tmp_path / "cache"))
    source = export_encoder(build_encoder(resolve_model_source("tiny:bert"), max_length=32), tmp_path / "source")
    traces, trace = [], export._export_graph
    monkeypatch.setattr(export, "_export_graph", lambda *a: traces.append(a) or trace(*a))
    folders = []
    threads = [threading.Thread(target=lambda: folders.append(export.cached_export(str(source), "onnx")))
               for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(traces) == 1 and len(folders) == 3 and len(set(folders)) == 1
    assert (folders[0] / "onnx" / "model.onnx").exists()
    with pytest.raises(RuntimeError, match="trace failed"):
        with building(tmp_path / "cache" / "broken") as staging:
            (staging / "half.bin").write_bytes(b"0")
            raise RuntimeError("trace failed")
    assert not [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".broken")]
