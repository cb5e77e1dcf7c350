"""A Ray Serve deployment that embeds texts with a registered model: ``POST /v1/embeddings`` in OpenAI's shape,
``GET /healthz``.

Requests are validated before any work and refused with a 4xx JSON error naming the problem (empty input, too many
texts, a text over the model's length, an unknown prompt name or dimension, a bad bearer token). Valid requests of
many clients are batched by ``@serve.batch`` into one encoder call per prompt name. A replica serving an alias
(``models:/raoe-s2@champion``) checks every ``reload_s`` seconds which version the alias names and, when it moved,
loads the new version and swaps it in between batches: no restart, no dropped request."""

import base64
import copy
import threading
import time
from dataclasses import dataclass

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from evaluation.search import normalised

app = FastAPI(title="raoe embeddings")


@dataclass(frozen=True)
class ServeSettings:
    """What a replica needs (a typed object across the process boundary)."""

    source: str  # a model source; an alias is followed (reload)
    format: str  # torch | merged | onnx | onnx_int8 | openvino
    max_texts: int  # per request
    max_batch_size: int  # requests serve.batch collects into one encoder call

    batch_wait_s: float
    reload_s: float  # 0: never check the alias again
    token: str | None  # bearer token; None: open
    batch_size: int  # texts per forward pass


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class LoadedModel:
    version: str  # what the source resolved to (models:/name/3, or the path)
    model: object
    dims: tuple[int, ...]  # the sizes it may be cut to: trained at (Matryoshka) or rotated for (rotate.dims)
    width: int
    max_tokens: int
    prompts: tuple[str, ...]
    length_tokenizer: object  # the model's tokenizer, copied: counts a request's tokens on the event loop while the
    # encoder's own tokenizer pads a batch in the executor thread (a fast tokenizer's padding and truncation are
    # state of the one object: shared between the two threads, a batch came out unpadded under load, a 500)


def load_model(settings: ServeSettings) -> LoadedModel:
    """The model the source names now, in the asked format (an export is built once into the model cache)."""
    from encoders.backbone import load_encoder
    from encoders.model_uris import resolve_alias, resolve_model

    version = resolve_alias(settings.source) if settings.source.startswith("models:/") else settings.source
    path = resolve_model(version)
    if settings.format == "torch":
        model = load_encoder(path)
    else:
        from encoders.export import cached_export, load_export

        model = load_export(cached_export(path, settings.format), settings.format)
    width = int(model.get_embedding_dimension())
    names = tuple(sorted(set(model.encoder_settings.prompts) | set(model.prompts or {})))
    return LoadedModel(version, model, tuple(model.encoder_settings.matryoshka_dims), width, int(model.max_seq_length),
                       names, copy.deepcopy(model.tokenizer))


def parse_request(body, loaded: LoadedModel,
                  settings: ServeSettings) -> tuple[list[str], str | None, int | None, str, int]:
    """(texts, prompt name, dimensions, encoding format, tokens) of an OpenAI embeddings request, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object with 'input'")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise RequestError("'input' must be a string or a list of strings", "input")
    if not texts or any(not t.strip() for t in texts):
        raise RequestError("'input' must hold at least one text, and no text may be empty", "input")
    if len(texts) > settings.max_texts:
        raise RequestError(f"'input' holds {len(texts)} texts; at most {settings.max_texts} per request "
                           f"(serve.max_texts)", "input", 413)
    prompt = body.get("prompt_name")
    if prompt is not None and prompt not in loaded.prompts:
        raise RequestError(f"unknown prompt_name {prompt!r}; this model has {list(loaded.prompts) or 'none'}",
                           "prompt_name")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or (dims != loaded.width and dims not in loaded.dims)):
        raise RequestError(f"dimensions {dims!r} is not a size this model may be cut to: "
                           f"{sorted(set(loaded.dims) | {loaded.width})}", "dimensions")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise RequestError(f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    counts = [len(ids) for ids in loaded.length_tokenizer(texts, add_special_tokens=True)["input_ids"]]
    for i, tokens in enumerate(counts):
        if tokens > loaded.max_tokens:
            raise RequestError(f"input[{i}] is {tokens} tokens; this model reads at most {loaded.max_tokens}",
                               "input")
    return texts, prompt, dims, fmt, sum(counts)


def response(vectors: np.ndarray, dims: int | None, fmt: str, model: str, tokens: int) -> dict:
    """OpenAI's embeddings response; a Matryoshka size is cut and renormalised."""
    if dims is not None and dims < vectors.shape[1]:
        vectors = normalised(vectors, dims)
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def error(exc: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param}},
                        status_code=exc.status)


@serve.deployment
@serve.ingress(app)
class EmbeddingServer:
    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.loaded = load_model(settings)
        self.embed_batch.set_max_batch_size(settings.max_batch_size)
        self.embed_batch.set_batch_wait_timeout_s(settings.batch_wait_s)
        if settings.reload_s > 0 and settings.source.startswith("models:/") and "@" in settings.source:
            threading.Thread(target=self._follow_alias, daemon=True).start()

    def _follow_alias(self) -> None:
        from encoders.model_uris import resolve_alias

        while True:
            time.sleep(self.settings.reload_s)
            try:
                if resolve_alias(self.settings.source) != self.loaded.version:
                    fresh = load_model(self.settings)
                    self.loaded = fresh  # one reference swap: a batch in flight keeps the model it started with
                    print(f"[raoe] {self.settings.source} now serves {fresh.version}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a registry outage keeps the model being served
                print(f"[raoe] could not check {self.settings.source}: {type(exc).__name__}: {exc}", flush=True)

    @app.get("/healthz")
    def healthz(self) -> dict:
        return {"status": "ok", "model": self.settings.source, "version": self.loaded.version}

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        if self.settings.token and request.headers.get("authorization") != f"Bearer {self.settings.token}":
            return error(RequestError("missing or wrong bearer token", None, 401))
        try:
            body = await request.json()
        except ValueError:
            return error(RequestError("the body is not JSON"))
        loaded = self.loaded
        try:
            texts, prompt, dims, fmt, tokens = parse_request(body, loaded, self.settings)
        except RequestError as exc:
            return error(exc)
        vectors, version = await self.embed_batch((texts, prompt))
        out = response(vectors, dims, fmt, body.get("model") or self.settings.source, tokens)
        return JSONResponse(out, headers={"x-raoe-model-version": version})

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)
    async def embed_batch(self, requests: list[tuple[list[str], str | None]]) -> list[tuple[np.ndarray, str]]:
        """Every waiting request's texts in one encoder call per prompt name, split back per request. The encoding
        runs off the event loop (torch releases the GIL), so requests keep arriving and form the next batch."""
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, self._encode, requests)

    def _encode(self, requests: list[tuple[list[str], str | None]]) -> list[tuple[np.ndarray, str]]:
        from encoders.backbone import embeddings_by_side

        loaded = self.loaded
        texts = [t for texts, _ in requests for t in texts]
        vectors = embeddings_by_side(loaded.model, texts, [p for texts, p in requests for _ in texts],
                                     self.settings.batch_size)
        ends = np.cumsum([len(texts) for texts, _ in requests])
        return [(part, loaded.version) for part in np.split(vectors, ends[:-1])]
