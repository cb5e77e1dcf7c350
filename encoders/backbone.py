"""The trainable sentence encoder: a transformers backbone plus pooling, held as a sentence-transformers model.

Training and inference share one module stack (``Transformer`` -> ``Pooling``), so the exported folder
gives, under ``SentenceTransformer(path)``, exactly the embeddings the training loop computed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from encoders.model_files import (  # noqa: F401  (MODEL_CARD re-exported)
    DEFAULT_PROMPT_NAME,
    MODEL_CARD,
    RAOE_META,
    SIDES,
    dense_head_folders,
    refuse_adapters_on_heads,
)
from encoders.relation_table import save_relation_table

# raoe's settings on every model it builds or loads (``model.encoder_settings``): what training ran, for inference
# and export

# raoe's pooling names -> sentence-transformers' Pooling modes
POOLING_MODES = {"mean": "mean", "cls": "cls", "last_token": "lasttoken"}


@dataclass(frozen=True)
class EncoderSettings:
    """What raoe knows of a model beyond sentence-transformers' own config, set on every model ``build_encoder`` and
    ``load_encoder`` return (``model.encoder_settings``) and written to ``raoe_encoder.json`` on export: the prompt
    template (sentence-transformers' prompts cannot express a suffix), the named prefixes of model.prompts (the
    query and document sides), the quantization to load its base with, the tokenizer's padding side, whether its
    shipped code may run, and an RSE model's relation names."""

    prompt: str | None = None
    prompts: dict[str, str] = field(default_factory=dict)  # name -> prefix (model.prompts)
    quantization: str = "none"
    padding_side: str | None = None
    trust_remote_code: bool = False
    relations: tuple[str, ...] = ()  # names of the relation table's rows (encoders.relation_table), RSE only
    matryoshka_dims: tuple[int, ...] = ()  # the leading sizes it was trained to embed at (objective.matryoshka)

    def template(self, side: str | None, prompts: dict[str, str] | None = None) -> str | None:
        """The prompt template of a text on ``side`` (a name of model.prompts, or None): its own prefix (from
        ``prompts`` when given: a data source's own), else model.prompt."""
        prefix = (self.prompts if prompts is None else prompts).get(side) if side else None
        return self.prompt if prefix is None else prefix + "{text}"


def dropout_overrides(model_path: str, dropout: float | None, trust_remote_code: bool = False) -> dict[str, float]:
    """Every float ``*dropout*`` field of the backbone's config set to ``dropout`` (architectures name them
    differently: BERT hidden/attention_probs, ModernBERT embedding/mlp/attention, Qwen attention)."""
    if dropout is None:
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return {k: dropout for k, v in config.to_dict().items() if "dropout" in k and isinstance(v, float)}


def prompt_prefix(prompt: str | None) -> str | None:
    """The text before ``{text}`` when the template is a pure prefix (what sentence-transformers' prompts
    can carry), else None."""
    if prompt is None:
        return None
    if prompt.count("{text}") != 1:
        raise ValueError(f"model.prompt must contain '{{text}}' exactly once, got {prompt!r}")
    return prompt.split("{text}")[0] if prompt.endswith("{text}") else None


def quantization_config(quantization: str):
    """transformers' BitsAndBytesConfig for QLoRA: NF4 with double quantisation and bf16 compute, or 8-bit."""
    if quantization in (None, "none"):
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"model.quantization must be none, nf4 or int8, got {quantization!r}")


def adapter_base(path: str) -> str | None:
    """The base model of a saved LoRA adapter folder, or None when ``path`` holds a full model."""
    config = Path(path) / "adapter_config.json"
    return json.loads(config.read_text())["base_model_name_or_path"] if config.exists() else None


def adapters_in_fp32(module: torch.nn.Module) -> None:
    """LoRA weights on a bf16-compute 4-bit base come out bf16: keep them fp32 in training and after reloading, as
    peft's ``autocast_adapter_dtype`` does (the base computes in bf16 either way; ``trainer.bf16`` never means bf16
    weights)."""
    for name, param in module.named_parameters():
        if "lora_" in name and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()


def dropout_settings(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, float]]:
    """Every dropout rate of ``model`` as (module, attribute, rate): ``nn.Dropout`` modules, and the float
    ``attention_dropout`` attributes some attention layers read directly."""
    settings = []
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            settings.append((module, "p", module.p))
        elif isinstance(getattr(module, "attention_dropout", None), float):
            settings.append((module, "attention_dropout", module.attention_dropout))
    return settings


@contextlib.contextmanager
def dropout_settings_applied(settings: list[tuple[torch.nn.Module, str, float]]):
    """Set the given rates inside the block, the rates found on entry restored after."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    try:
        for module, name, value in settings:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


class DropoutReplay:
    """``context_fn`` for torch's non-reentrant checkpointing: the recompute in backward runs every dropout at the
    rate it had in the forward. torch replays the RNG state, not module attributes, so a rate set only around one
    forward (SAN's p2 for the aligned negatives) would otherwise be recomputed at the model's own rate, and the
    gradient would differ from the run without checkpointing."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self):
        return contextlib.nullcontext(), dropout_settings_applied(dropout_settings(self.model))


def build_encoder(model_path: str, *, pooling: str = "mean", max_length: int = 64, dropout: float | None = None,
                  prompt: str | None = None, prompts: dict[str, str] | None = None,
                  query_max_length: int | None = None, document_max_length: int | None = None,
                  device: str = "cpu", quantization: str = "none",
                  lora: dict[str, Any] | None = None, padding_side: str | None = None,
                  gradient_checkpointing: bool = False, trust_remote_code: bool = False):
    """A SentenceTransformer [Transformer, Pooling] over the backbone at ``model_path`` (an HF folder, an exported
    raoe/sentence-transformers folder whose weights sit at its root, or a saved LoRA adapter folder), followed by
    the folder's Dense modules after pooling if it has any (a rotation from ray_jobs/rotate.py, a projection head).

    QLoRA: ``quantization`` loads the base frozen in 4-bit NF4 (or 8-bit), ``lora`` adds trainable adapters; only
    the adapters have gradients, and saving the model saves only them. Code shipped with a hub model runs only with
    ``trust_remote_code`` (model.trust_remote_code), never by default.

    ``prompts`` and the query / document lengths are sentence-transformers' own (the model's prompts, the
    Transformer's ``query_length`` / ``document_length``), so ``encode_query`` / ``encode_document`` of the export
    encode as training did."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    if pooling not in POOLING_MODES:
        raise ValueError(f"model.pooling must be one of {sorted(POOLING_MODES)}, got {pooling!r}")
    prefix = prompt_prefix(prompt)
    adapter = adapter_base(model_path)
    refuse_adapters_on_heads(model_path, bool(lora or adapter), quantization)
    base = adapter or model_path
    remote = {"trust_remote_code": True} if trust_remote_code else {}
    model_kwargs = dict(remote)
    quant = quantization_config(quantization)
    if quant is not None:
        model_kwargs["quantization_config"] = quant
    transformer = Transformer(base, max_seq_length=max_length, query_length=query_max_length,
                              document_length=document_max_length, model_kwargs=model_kwargs or None,
                              config_kwargs={**dropout_overrides(base, dropout, trust_remote_code), **remote} or None,
                              processor_kwargs=remote or None, tokenizer_name_or_path=model_path if adapter else None)
    tokenizer = transformer.tokenizer
    if tokenizer.pad_token is None:  # causal LMs ship without one
        tokenizer.pad_token = tokenizer.eos_token
    if padding_side:
        tokenizer.padding_side = padding_side
    auto_model = transformer.auto_model
    if quant is not None or lora or adapter:
        for param in auto_model.parameters():  # the base stays frozen; only adapters train
            param.requires_grad_(False)
    # Non-reentrant checkpointing: with reentrant segments (torch's and peft's default) each segment runs its own
    # backward, so a weight used in two forward passes of one step (length buckets) gets two gradient hooks, and
    # DDP/ZeRO reduce a partial gradient: wrong across workers (the exact-gradient tests catch it).
    # DropoutReplay: the recompute uses the dropout rates of its forward, not those in force during backward.
    checkpointing = {"use_reentrant": False, "context_fn": DropoutReplay(auto_model)}
    if quant is not None:
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(auto_model, use_gradient_checkpointing=gradient_checkpointing,
                                        gradient_checkpointing_kwargs=checkpointing)
    elif gradient_checkpointing:
        auto_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    if adapter:
        auto_model.load_adapter(model_path, adapter_name="default", is_trainable=bool(lora))
    elif lora:
        from peft import LoraConfig

        auto_model.add_adapter(LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                          target_modules=lora["target_modules"], bias="none"))
    adapters_in_fp32(auto_model)
    for name, param in auto_model.named_parameters():
        if name.startswith("pooler."):  # BERT's pooler is not on the embedding's path: a frozen, gradient-free
            param.requires_grad_(False)  # parameter would stall DDP's gradient all-reduce
    dim = auto_model.config.hidden_size
    pool = Pooling(dim, pooling_mode=POOLING_MODES[pooling])
    heads = dense_heads(model_path)
    named = {**({DEFAULT_PROMPT_NAME: prefix} if prefix else {}), **(prompts or {})}
    model = SentenceTransformer(modules=[transformer, pool, *heads], device=device if quant is None else None,
                                prompts=named or None, default_prompt_name=DEFAULT_PROMPT_NAME if prefix else None)
    model.encoder_settings = EncoderSettings(prompt=prompt, prompts=dict(prompts or {}),
                                             quantization=quantization if quant is not None else "none",
                                             padding_side=tokenizer.padding_side, trust_remote_code=trust_remote_code)
    return model


def apply_prompt(texts: list[str], prompt: str | None) -> list[str]:
    return list(texts) if not prompt else [prompt.replace("{text}", t) for t in texts]


def side_encoding(model, side: str | None, prompts: dict[str, str] | None = None) -> tuple[str | None, int | None]:
    """(prompt template, max tokens) of a text on ``side`` (``prompts``: a data source's own): texts whose encodings
    are equal may share a forward pass."""
    module = model[0]
    length = {"query": getattr(module, "query_length", None),
              "document": getattr(module, "document_length", None)}.get(side or "")
    return model.encoder_settings.template(side, prompts), length or model.max_seq_length


def tokenize(model, texts: list[str], device: str | torch.device = "cpu",
             tokens: "TokenCache | None" = None, side: str | None = None,
             prompts: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Tokenised, dynamically padded inputs with the prompt template of ``side`` applied (padded to the longest
    text of this batch, at most the side's max length): prepared ahead in ``tokens`` when it holds these texts,
    else tokenised here."""
    features = tokens.features(model, texts, side, prompts) if tokens is not None else \
        preprocessed(model, texts, side=side, prompts=prompts)
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in features.items()}


def preprocessed(model, texts: list[str], pin: bool = False, side: str | None = None,
                 prompts: dict[str, str] | None = None) -> dict[str, Any]:
    """sentence-transformers' own preprocessing of one forward pass's texts on ``side`` (its task: the query or
    document length; ``prompts``: a data source's own), on the host (pinned for a non-blocking copy to a GPU when
    ``pin``)."""
    task = {"task": side} if side in SIDES else {}
    features = model.preprocess(apply_prompt(texts, model.encoder_settings.template(side, prompts)), **task)
    return {k: v.pin_memory() if pin and isinstance(v, torch.Tensor) else v for k, v in features.items()}


class TokenCache:
    """Tokenised inputs of the next micro-batch, prepared while the current one trains (training.rows'
    MicroBatchFeed) and looked up by the side and exact texts of each forward pass. A forward pass whose texts were not
    prepared is tokenised where it runs (counted in ``misses``), so a wrong prediction costs time, never
    correctness. One lock serialises the tokeniser between the two threads (a fast tokeniser is not re-entrant)."""

    def __init__(self):
        self._ready: dict[tuple, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def prepare(self, model, calls: list[tuple[list[str], int, str | None]], pin: bool = False,
                prompts: dict[str, str] | None = None) -> dict:
        """The features of every forward pass that ``encode`` calls of (texts, buckets, side) will run (any
        thread)."""
        ready = {}
        for texts, buckets, side in calls:
            template = model.encoder_settings.template(side, prompts)
            for group in length_groups(texts, buckets):
                chunk = [texts[i] for i in group]
                with self._lock:
                    ready[(template, side, *chunk)] = preprocessed(model, chunk, pin, side, prompts)
        return ready

    def use(self, ready: dict) -> None:
        """The prepared features of the micro-batch about to run (what ``prepare`` gave)."""
        self._ready = ready

    def features(self, model, texts: list[str], side: str | None = None,
                 prompts: dict[str, str] | None = None) -> dict[str, Any]:
        template = model.encoder_settings.template(side, prompts)
        found = self._ready.get((template, side, *texts))  # kept: a cached-embeddings step encodes each chunk twice
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        with self._lock:
            return preprocessed(model, texts, side=side, prompts=prompts)


def forward_pass(module, model, texts: list[str], device: str | torch.device = "cpu",
                 tokens: TokenCache | None = None, side: str | None = None,
                 prompts: dict[str, str] | None = None) -> torch.Tensor:
    """Sentence embeddings with gradient, in one forward pass over texts on ``side``. ``module`` is what runs the
    forward (the model itself, or its DDP/DeepSpeed wrapper); ``model`` is the bare SentenceTransformer (for its
    tokenizer)."""
    return module(tokenize(model, texts, device, tokens, side, prompts))["sentence_embedding"]


def length_groups(texts: list[str], buckets: int) -> list[list[int]]:
    """The positions of the texts each forward pass of ``forward_in_length_buckets`` takes: ``buckets`` groups of
    texts sorted by length whenever there are ``2 * buckets`` texts or more, else one group in input order."""
    if buckets <= 1 or len(texts) < 2 * buckets:
        return [list(range(len(texts)))]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    bounds = [len(texts) * b // buckets for b in range(buckets + 1)]
    return [order[start:end] for start, end in zip(bounds, bounds[1:])]


def forward_in_length_buckets(module, model, texts: list[str], device: str | torch.device = "cpu",
                              buckets: int = 2, tokens: TokenCache | None = None,
                              side: str | None = None, prompts: dict[str, str] | None = None) -> torch.Tensor:
    """``forward_pass`` in ``buckets`` forward passes over the texts grouped by length, each padded only to its own longest
    text (an SNLI premise is about twice as long as its hypothesis); embeddings come back in input order.
    Exactly ``buckets`` passes whenever there are ``2 * buckets`` texts or more, whatever their count, so workers
    given the same ``buckets`` (training.kinds.base.BatchContext) run the same number of forward passes."""
    groups = length_groups(texts, buckets)
    if len(groups) == 1:
        return forward_pass(module, model, texts, device, tokens, side, prompts)
    parts = [forward_pass(module, model, [texts[i] for i in group], device, tokens, side, prompts) for group in groups]
    inverse = torch.tensor([i for group in groups for i in group]).argsort()  # each input text's place in the parts
    return torch.cat(parts)[inverse.to(parts[0].device)]


def text_ids(texts: list[str]) -> torch.Tensor:
    """Stable 63-bit ids of texts, equal across workers and processes (AnglE's in-batch negatives must not
    count a duplicate of the positive as a negative)."""
    ids = [int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little") >> 1 for t in texts]
    return torch.tensor(ids, dtype=torch.long)


def dense_heads(model_path: str) -> list[torch.nn.Module]:
    """The Dense modules after pooling of a sentence-transformers folder (a principal-axes rotation, a projection
    head), loaded with their weights, so training computes what the model computes; none for a bare backbone."""
    from sentence_transformers.sentence_transformer.modules import Dense

    return [Dense.load(str(folder)) for folder in dense_head_folders(model_path)]


def export_encoder(model, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Save in sentence-transformers format (modules.json, pooling config, prompts) plus raoe's metadata."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save(str(path), create_model_card=False)
    settings = model.encoder_settings
    info = {k: v for k, v in asdict(settings).items() if k != "relations"}
    (path / RAOE_META).write_text(json.dumps({**info, **(meta or {})}, indent=2, default=str))
    if settings.relations:  # an RSE model: its relation table next to the encoder
        save_relation_table(model, settings.relations, path)
    return path


def load_encoder(path: str | Path, device: str = "cpu"):
    """Load an exported model for inference as training ran it: restores a prompt template that
    sentence-transformers' prefix prompts cannot express, and a 4-bit/8-bit base under a LoRA adapter."""
    from sentence_transformers import SentenceTransformer

    meta_file = Path(path) / RAOE_META
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    quant = quantization_config(meta.get("quantization", "none"))
    model_kwargs = {"quantization_config": quant} if quant is not None else {}
    model = SentenceTransformer(str(path), device=device if quant is None else None,  # else device_map's
                                model_kwargs=model_kwargs or None,
                                trust_remote_code=bool(meta.get("trust_remote_code")))  # as its training run chose
    adapter_file = Path(path) / "adapter_model.safetensors"
    if quant is not None and adapter_file.exists():  # peft loaded the saved fp32 adapter into bf16: load it again
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        auto_model = model[0].auto_model
        adapters_in_fp32(auto_model)
        saved = {k.removeprefix("base_model.model."): v for k, v in load_file(str(adapter_file)).items()}
        set_peft_model_state_dict(auto_model, saved, adapter_name="default")
    if meta.get("padding_side"):
        model.tokenizer.padding_side = meta["padding_side"]
    prompt, prompts = (meta.get("prompt"), meta.get("prompts", {})) if meta else shipped_prompts(model)
    model.encoder_settings = EncoderSettings(prompt=prompt, prompts=prompts,
                                             quantization=meta.get("quantization", "none"),
                                             matryoshka_dims=tuple(meta.get("matryoshka_dims", ())),
                                             padding_side=model.tokenizer.padding_side,
                                             trust_remote_code=bool(meta.get("trust_remote_code")))
    return model


def embeddings_by_side(model, texts: list[str], sides: list[str | None], batch_size: int = 64) -> "np.ndarray":  # noqa: F821
    """``inference_embeddings`` of texts of several sides at once: each side's texts with its own prompt and max
    length, back in the texts' order."""
    import numpy as np

    out = None
    for side in dict.fromkeys(sides):
        rows = [i for i, s in enumerate(sides) if s == side]
        part = inference_embeddings(model, [texts[i] for i in rows], batch_size, side)
        out = np.zeros((len(texts), part.shape[1]), dtype=part.dtype) if out is None else out
        out[rows] = part
    return out if out is not None else np.zeros((0, 0), dtype=np.float32)


def shipped_prompts(model) -> tuple[str | None, dict[str, str]]:
    """(model.prompt, model.prompts) of a sentence-transformers model raoe did not train (an E5 or BGE from the
    hub): its own prompts (an empty one meaning none, not the default), its default prompt applied to texts of no
    side, as its ``encode`` does."""
    prompts = dict(model.prompts or {})
    default = prompts.get(model.default_prompt_name) if model.default_prompt_name else None
    return (default + "{text}" if default else None), prompts


def with_matryoshka(model, dims: list[int]) -> None:
    """Record the embedding sizes a Matryoshka objective trained (the export's raoe_encoder.json and model card)."""
    model.encoder_settings = replace(model.encoder_settings, matryoshka_dims=tuple(dims))


def with_relations(model, names: list[str]) -> None:
    """Record an RSE model's relation names in its settings (the table itself is a parameter of the model)."""
    model.encoder_settings = replace(model.encoder_settings, relations=tuple(names))


def inference_embeddings(model, texts: list[str], batch_size: int = 64,
                         side: str | None = None) -> "np.ndarray":  # noqa: F821
    """Inference embeddings (numpy): eval mode, no gradient, length-sorted batches, the prompt template and max
    length of ``side`` (None: model.prompt, max_length)."""
    import numpy as np

    was_training = model.training
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = [None] * len(texts)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            emb = forward_pass(model, model, [texts[i] for i in idx], model.device, side=side).float().cpu().numpy()
            for i, e in zip(idx, emb):
                out[i] = e
    model.train(was_training)
    return np.stack(out) if out else np.zeros((0, 0), dtype=np.float32)
