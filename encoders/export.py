"""Exports of a trained model for other runtimes: a merged full-precision folder, ONNX, ONNX int8 and OpenVINO.

``merged``: the function the model computes, as a plain sentence-transformers folder. A LoRA adapter is folded into
its base's weights; a 4-bit or 8-bit base is dequantised first, so the merged weights are the ones the model computed
with (merging into the original full-precision base would change it by the quantisation error); saved in fp32, bf16
or fp16.

``onnx``: that folder, less the transformer's weights, plus ``onnx/model.onnx``, the transformer's graph (inputs as
its tokenizer names them, output ``last_hidden_state``): sentence-transformers' own ONNX layout, its pooling and
normalisation modules beside the graph, so ``SentenceTransformer(folder, backend="onnx")`` loads it where optimum is
installed. ``onnx_int8``: the same with ``onnx/model_qint8.onnx``: the feed-forward up-projections' weights quantised
to 8 bits per output channel by onnxruntime's dynamic quantisation (``expanding_matmuls``). ``openvino`` (where the
openvino package is installed): the folder (less the transformer's weights) plus ``openvino/openvino_model.xml``, the
same graph as OpenVINO IR in fp32, sentence-transformers' OpenVINO layout (``backend="openvino"`` where
optimum-intel is installed).

``load_export`` runs such a folder here: sentence-transformers' preprocessing, prompts, sides, pooling and
normalisation, with the transformer's forward pass in onnxruntime (or OpenVINO)."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import torch

from encoders.export_formats import OPENVINO_PACKAGE
from encoders.model_files import RAOE_META

EXPORT_VERSION = 2  # in cached exports' names: 2 quantises the up-projections alone (1 quantised every MatMul)
ONNX_FILE = {"onnx": "onnx/model.onnx", "onnx_int8": "onnx/model_qint8.onnx"}
OPENVINO_FILE = "openvino/openvino_model.xml"  # sentence-transformers' OpenVINO layout (its weights in the .bin beside)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def merged_model(model_path: str):
    """The model at ``model_path`` as a full-precision sentence-transformers model computing the same function:
    LoRA layers folded into their (dequantised) base weights, quantised layers dequantised."""
    from encoders.backbone import load_encoder

    model = load_encoder(model_path)
    auto = model[0].auto_model
    if _fold_layers(auto):
        if hasattr(auto, "get_base_model"):  # a PeftModel around the transformer: the transformer itself
            auto = auto.get_base_model()
            _set_transformer(model[0], auto)
        # the adapter's load renamed its keys (transformers' _weight_conversions) and would rename them back on save
        for attr in ("peft_config", "hf_quantizer", "quantization_method", "_weight_conversions"):
            if hasattr(auto, attr):
                delattr(auto, attr)
        auto._hf_peft_config_loaded = False
        auto.is_quantized = False
        if hasattr(auto.config, "quantization_config"):
            del auto.config.quantization_config
    auto.float()
    model.encoder_settings = replace(model.encoder_settings, quantization="none")
    return model


def _fold_layers(module: torch.nn.Module) -> int:
    """Replace every LoRA layer by a plain Linear holding base + delta, and every quantised Linear by its
    dequantised weights; returns how many layers were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        plain = _plain_linear(child)
        if plain is not None:
            setattr(module, name, plain)
            replaced += 1
        else:
            replaced += _fold_layers(child)
    return replaced


def _plain_linear(layer: torch.nn.Module) -> torch.nn.Linear | None:
    """The nn.Linear computing what ``layer`` computes (a LoRA layer, a 4-/8-bit Linear), or None for any other."""
    base, delta = layer, None
    if hasattr(layer, "get_base_layer") and hasattr(layer, "lora_A"):  # peft's LoRA layer
        base = layer.get_base_layer()
        delta = sum((layer.get_delta_weight(a).float() for a in layer.active_adapters if a in layer.lora_A),
                    torch.zeros(()))
    weight = _dequantised(base)
    if weight is None:
        if delta is None or not isinstance(base, torch.nn.Linear):
            return None
        weight = base.weight.detach().float()
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=base.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight + (delta if delta is not None else 0))
        if base.bias is not None:
            linear.bias.copy_(base.bias.detach().float())
    return linear


def _dequantised(layer: torch.nn.Module) -> torch.Tensor | None:
    """A bitsandbytes 4-bit or 8-bit Linear's weight in fp32 (None for any other layer)."""
    kind = type(layer).__name__
    if kind == "Linear4bit":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    if kind == "Linear8bitLt":
        state = layer.state
        scale = (state.SCB if state.SCB is not None else layer.weight.SCB).float()
        return layer.weight.data.float() * scale.unsqueeze(1) / 127.0
    return None


def save_merged(model_path: str, out: str | Path, dtype: str = "float32") -> Path:
    """``merged``: the full-precision model saved in ``dtype``, with raoe's settings (no quantisation, no adapter)."""
    from encoders.backbone import export_encoder

    model = merged_model(model_path)
    model[0].auto_model.to(DTYPES[dtype])
    out = export_encoder(model, out, meta=_source_meta(model_path) | {"exported_from": model_path, "dtype": dtype})
    return out


def trace_onnx(merged_folder: str | Path, out: str | Path) -> Path:
    """The fp32 merged folder's transformer traced once into ``out/onnx/model.onnx`` (its weights beside it past
    2 GB), nothing else: what ``save_onnx`` and ``save_openvino`` take as ``traced``, so a job asking for several
    graph formats traces once and copies no weights it does not keep."""
    graph = Path(out) / ONNX_FILE["onnx"]
    if Path(out).exists():
        shutil.rmtree(out)
    graph.parent.mkdir(parents=True)
    _export_graph(merged_folder, graph)
    return Path(out)


def save_onnx(merged_folder: str | Path, out: str | Path, int8: bool = False, traced: str | Path | None = None) -> Path:
    """``onnx`` (or ``onnx_int8``): a copy of the fp32 merged folder, less the transformer's weights, with its graph
    in onnx/: the graph of ``traced`` (``trace_onnx`` of the same folder, linked where it can be) when given, else
    traced here. A 7B trace takes minutes and the model's weights in memory: a job asking for several formats traces
    once."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    _copy_without_the_transformers_weights(merged_folder, out)
    graph = out / ONNX_FILE["onnx"]
    graph.parent.mkdir(parents=True, exist_ok=True)
    if traced is not None:
        graph = Path(traced) / ONNX_FILE["onnx"]
        if not int8:
            for name in [*weight_files(graph), graph.name]:
                _link_or_copy(graph.parent / name, out / "onnx" / name)
            return out
    else:
        _export_graph(merged_folder, graph)
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # A graph past protobuf's 2 GB keeps its weights outside (torch's exporter writes a file per tensor there):
        # so does its quantised copy, in one file beside it, or it cannot be written at all (a 7B decoder).
        quantize_dynamic(str(graph), str(out / ONNX_FILE["onnx_int8"]), weight_type=QuantType.QUInt8,
                         per_channel=True, nodes_to_quantize=expanding_matmuls(graph),
                         use_external_data_format=bool(weight_files(graph)))
        if graph.parent == out / "onnx":  # traced here for this copy only
            for name in [*weight_files(graph), graph.name]:
                (graph.parent / name).unlink()
    return out


def _copy_without_the_transformers_weights(merged_folder: str | Path, out: Path) -> None:
    """The merged folder (config, tokenizer, modules, a Dense head's weights) but the transformer's own weights: the
    graph holds them, and a 7B model's are 28 GB in fp32 that an ONNX or OpenVINO server never reads."""
    modules = json.loads((Path(merged_folder) / "modules.json").read_text())
    transformer = (Path(merged_folder) / modules[0]["path"]).resolve()

    def weights(folder: str, names: list[str]) -> list[str]:
        if Path(folder).resolve() != transformer:
            return []
        return [n for n in names if n.startswith(("model", "pytorch_model")) and n.endswith(
            (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))]

    shutil.copytree(merged_folder, out, ignore=weights)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where both are on one file system (a 7B graph's 28 GB of weights are not written twice)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def save_openvino(merged_folder: str | Path, out: str | Path, traced: str | Path | None = None) -> Path:
    """``openvino``: a copy of the fp32 merged folder, less the transformer's weights, with the transformer as
    OpenVINO IR in openvino/, read from ``traced``'s ONNX graph when given (else traced here): fp32 weights
    (OpenVINO's own default halves them). Read with ``Core.read_model``, not ``convert_model``, which sends usage
    telemetry unless opted out."""
    ov = _openvino()

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    _copy_without_the_transformers_weights(merged_folder, out)
    graph = Path(traced) / ONNX_FILE["onnx"] if traced is not None else out / "onnx-trace" / "model.onnx"
    if traced is None:
        graph.parent.mkdir()
        _export_graph(merged_folder, graph)
    target = out / OPENVINO_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(ov.Core().read_model(str(graph)), str(target), compress_to_fp16=False)
    if traced is None:
        shutil.rmtree(graph.parent)
    return out


def _openvino():
    """The openvino package, or an error saying where it is missing: a config checked on the driver may run on a
    node that lacks it."""
    try:
        import openvino
    except ImportError as exc:
        raise ModuleNotFoundError(f"the openvino format runs on this node ({os.uname().nodename}) but the openvino "
                                  f"package is not installed here: pip install {OPENVINO_PACKAGE} on every node") \
            from exc
    return openvino


def weight_files(graph: Path) -> list[str]:
    """The files beside ``graph`` holding its weights (none for a graph under 2 GB: they are inside it)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    return sorted({entry.value for w in model.graph.initializer if w.data_location == onnx.TensorProto.EXTERNAL
                   for entry in w.external_data if entry.key == "location"})


def expanding_matmuls(graph: Path) -> list[str]:
    """The MatMul nodes whose constant weight widens its input (out > in features): the feed-forward up-projections
    (BERT's intermediate, a decoder's gate and up), most of a transformer's weights. Only these are quantised: on
    the MiniLM student, quantising every MatMul (per-channel uint8) moved the least text cosine to 0.975 of the fp32
    graph's and the up-projections alone to 0.990 (2,909 STS-B dev texts, measured here), at nearly the same
    speed; per-tensor scales, onnxruntime's default, gave 0.93."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    weights = {w.name: list(w.dims) for w in model.graph.initializer}
    return [node.name for node in model.graph.node if node.op_type == "MatMul" and len(node.input) > 1
            and len(weights.get(node.input[1], [])) == 2 and weights[node.input[1]][1] > weights[node.input[1]][0]]


def _export_graph(folder: str | Path, target: Path) -> None:
    """torch.onnx.export of the folder's transformer: inputs named as its tokenizer's, dynamic batch and length."""
    from encoders.backbone import load_encoder, preprocessed

    model = load_encoder(str(folder))
    transformer = model[0].auto_model.eval()
    sample = preprocessed(model, ["an example sentence to trace", "two"])
    accepted = inspect.signature(transformer.forward).parameters  # a tokenizer may emit what the model does not take
    names = [k for k in model.tokenizer.model_input_names if k in sample and k in accepted]

    class Graph(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            return self.inner(**dict(zip(names, inputs))).last_hidden_state

    axes = {name: {0: "batch", 1: "tokens"} for name in names} | {"last_hidden_state": {0: "batch", 1: "tokens"}}
    with torch.no_grad():
        torch.onnx.export(Graph(transformer), tuple(sample[n] for n in names), str(target), input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)


class _OnnxForward(torch.nn.Module):
    """Stands in for a sentence-transformers Transformer's ``auto_model``: its forward pass in onnxruntime."""

    def __init__(self, graph: Path, config, threads: int | None = None):
        import onnxruntime as ort

        super().__init__()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.config = config

    def forward(self, **features):
        from transformers.modeling_outputs import BaseModelOutput

        feeds = {k: features[k].cpu().numpy() for k in self.inputs}
        hidden = self.session.run(["last_hidden_state"], feeds)[0]
        return BaseModelOutput(last_hidden_state=torch.from_numpy(hidden))


class _OpenVinoForward(torch.nn.Module):
    """Stands in for a sentence-transformers Transformer's ``auto_model``: its forward pass in OpenVINO, in fp32 (on
    a CPU with bf16 units OpenVINO would compute in bf16 by default: 0.12 off in the hidden states of MiniLM here)."""

    def __init__(self, graph: Path, config, threads: int):
        super().__init__()
        self.compiled = _openvino().Core().compile_model(str(graph), "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                                            "INFERENCE_NUM_THREADS": threads})
        self.inputs = [i.get_any_name() for i in self.compiled.inputs]
        self.config = config

    def forward(self, **features):
        from transformers.modeling_outputs import BaseModelOutput

        hidden = self.compiled({k: features[k].cpu().numpy() for k in self.inputs})[0]
        return BaseModelOutput(last_hidden_state=torch.from_numpy(hidden))


def load_onnx(folder: str | Path, fmt: str = "onnx"):
    """An ONNX or OpenVINO export as a sentence-transformers model whose transformer runs in onnxruntime or OpenVINO
    (``encode``, ``encode_query``, raoe's ``inference_embeddings`` all work on it). No torch transformer is built:
    the folder holds none of its weights."""
    from encoders.backbone import load_encoder

    threads = torch.get_num_threads()  # the actor's or replica's CPUs (Ray sets them), not every core of the node

    def graph(config) -> torch.nn.Module:
        if fmt == "openvino":
            return _OpenVinoForward(Path(folder) / OPENVINO_FILE, config, threads)
        return _OnnxForward(Path(folder) / ONNX_FILE[fmt], config, threads)

    with _graph_in_the_transformers_place(graph):
        return load_encoder(str(folder))


_GRAPH = threading.local()  # the graph runtime of the export this thread is loading, if any
_INSTALLING = threading.Lock()


@contextlib.contextmanager
def _graph_in_the_transformers_place(graph):
    """While a folder loads on this thread, sentence-transformers' Transformer module takes ``graph(config)`` as its
    model instead of ``from_pretrained``'s: its tokenizer, prompts, sides and later modules (a Dense head with its
    weights) load as for the torch model, and no weights file is read or needed. sentence-transformers has no hook
    for this (its own ``backend="onnx"`` needs optimum): its loader is wrapped once per process, and the wrapper
    builds the graph only for the thread inside this block (a torch model loading on another thread meanwhile loads
    its weights)."""
    with _INSTALLING:
        _wrap_the_transformer_loader()
    _GRAPH.build = graph
    try:
        yield
    finally:
        _GRAPH.build = None


def _wrap_the_transformer_loader() -> None:
    from sentence_transformers.base.modules.transformer import Transformer

    original = Transformer._load_model
    if getattr(original, "raoe_graph_aware", False):
        return

    def load_model(self, model_name_or_path, transformer_task, config, backend, is_peft_model, **model_kwargs):
        build = getattr(_GRAPH, "build", None)
        if build is None:
            return original(self, model_name_or_path, transformer_task, config, backend, is_peft_model, **model_kwargs)
        return build(config)

    load_model.raoe_graph_aware = True
    Transformer._load_model = load_model


def _set_transformer(module, inner: torch.nn.Module) -> None:
    """Put ``inner`` where a sentence-transformers Transformer module runs its model (``model``; ``auto_model`` is
    a read-only alias of it in sentence-transformers 6)."""
    module.model = inner


def load_export(folder: str | Path, fmt: str, device: str = "cpu"):
    """A model of any export format, ready to encode: ``merged`` on ``device``, the graphs on the CPU."""
    from encoders.backbone import load_encoder

    return load_encoder(str(folder), device=device) if fmt == "merged" else load_onnx(folder, fmt)


def cached_export(model_path: str, fmt: str) -> Path:
    """An export of ``model_path`` built once per model content and format under RAOE_CACHE/exports (a serving
    replica asked for ONNX builds it on its first start; ray_jobs/export.py checks its parity)."""
    from encoders.cache import building, cache_root
    from storage.digests import tree_digest

    target = cache_root() / "exports" / f"{tree_digest(model_path)[:20]}-{fmt}-v{EXPORT_VERSION}"
    if not (target / ".complete").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with _one_builder(target):  # a node's other actors and replicas wait for this build, then load it
            if not (target / ".complete").exists():
                with building(target) as staging:
                    merged = save_merged(model_path, staging / "merged")
                    if fmt == "openvino":
                        save_openvino(merged, staging / fmt)
                    elif fmt != "merged":
                        save_onnx(merged, staging / fmt, int8=fmt == "onnx_int8")
    return target / fmt


@contextlib.contextmanager
def _one_builder(target: Path):
    """An exclusive lock on ``target``'s lock file while it is built: eight actors starting on a node would otherwise
    each load and trace the model at once (at 7B, eight times its weights in memory) for one folder."""
    import fcntl

    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _source_meta(model_path: str) -> dict:
    meta_file = Path(model_path) / RAOE_META
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    return {k: v for k, v in meta.items() if k in ("matryoshka_dims",)}

