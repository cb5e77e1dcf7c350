import numpy as np
import pytest
import torch

from encoders.backbone import (
    build_encoder,
    dropout_overrides,
    export_encoder,
    forward_pass,
    inference_embeddings,
    load_encoder,
)
from encoders.sources import resolve_model_source

TEXTS = ["a man is playing music.", "two dogs run", "the woman is eating food in the park with a child"]


@pytest.fixture(scope="module")
def tiny_path():
    return resolve_model_source("tiny:bert")


def _manual(model, texts, pooling):
    feats = model.tokenize(texts)
    hidden = model[0].auto_model(input_ids=feats["input_ids"], attention_mask=feats["attention_mask"]).last_hidden_state
    mask = feats["attention_mask"]
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "mean":
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    last = mask.sum(1) - 1  # right padding: the last real token
    return hidden[torch.arange(len(texts)), last]


@pytest.mark.parametrize("pooling", ["mean", "cls", "last_token"])
def test_pooling_matches_a_direct_computation(tiny_path, pooling):
    model = build_encoder(tiny_path, pooling=pooling, dropout=0.0)
    model.eval()
    with torch.no_grad():
        got = forward_pass(model, model, TEXTS)
        want = _manual(model, TEXTS, pooling)
    assert torch.allclose(got, want, atol=1e-5)


def test_exported_model_loads_in_sentence_transformers_with_identical_embeddings(tiny_path, tmp_path):
    from sentence_transformers import SentenceTransformer

    model = build_encoder(tiny_path, pooling="cls", dropout=0.0, prompt="query: {text}")
    with torch.no_grad():
        for p in model.parameters():  # a trained-looking model, not the file on disk
            p.add_(0.01 * torch.randn_like(p))
    trained = inference_embeddings(model, TEXTS)
    export_encoder(model, tmp_path / "m")
    reloaded = SentenceTransformer(str(tmp_path / "m"), device="cpu").encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(reloaded, trained, atol=1e-5)
    untrained = build_encoder(tiny_path, pooling="cls", prompt="query: {text}")
    assert not np.allclose(trained, inference_embeddings(untrained, TEXTS))


def test_prompt_templates_with_a_suffix_survive_export_through_raoes_loader(tiny_path, tmp_path):
    prompt = "Summarize sentence {text} in one word:"
    model = build_encoder(tiny_path, pooling="mean", dropout=0.0, prompt=prompt)
    export_encoder(model, tmp_path / "m")
    reloaded = load_encoder(tmp_path / "m")
    assert reloaded.encoder_settings.prompt == prompt
    np.testing.assert_allclose(inference_embeddings(reloaded, TEXTS), inference_embeddings(model, TEXTS), atol=1e-5)
    plain = inference_embeddings(build_encoder(tiny_path, pooling="mean", dropout=0.0), TEXTS)
    assert not np.allclose(plain, inference_embeddings(model, TEXTS), atol=1e-3)


def test_dropout_override_reaches_every_dropout_field(tiny_path):
    overrides = dropout_overrides(tiny_path, 0.0)
    assert overrides == {"attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}
    model = build_encoder(tiny_path, dropout=0.0)
    model.train()
    a, b = forward_pass(model, model, TEXTS), forward_pass(model, model, TEXTS)
    assert torch.equal(a, b)  # no dropout noise in training mode


def test_bad_prompt_is_rejected(tiny_path):
    with pytest.raises(ValueError, match="model.prompt"):
        build_encoder(tiny_path, prompt="no placeholder")


@pytest.mark.parametrize("buckets", [1, 2, 3])
def test_length_buckets_give_the_one_pass_embeddings_in_input_order(tiny_path, buckets):
    from encoders.backbone import forward_in_length_buckets

    texts = TEXTS * 3 + ["a", "the quick brown fox jumps over the lazy dog near the river bank today"]
    model = build_encoder(tiny_path, pooling="mean", dropout=0.0)
    model.eval()
    got = forward_in_length_buckets(model, model, texts, buckets=buckets)
    with torch.no_grad():
        want = forward_pass(model, model, texts)
    assert torch.allclose(got.detach(), want, atol=1e-5)
    got.sum().backward()  # one graph through every bucket's forward
    assert model[0].auto_model.embeddings.word_embeddings.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("buckets", [2, 3, 4])
def test_length_buckets_run_exactly_buckets_passes_for_any_text_count(tiny_path, buckets):
    """Workers that agreed on ``buckets`` must run the same number of forward passes (each is a collective under
    DDP and ZeRO-3) whatever their text counts: 9 texts in 4 buckets once ran 3 passes where 8 texts ran 4."""
    from encoders.backbone import forward_in_length_buckets

    model = build_encoder(tiny_path, pooling="mean", dropout=0.0)
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    for count in range(2 * buckets, 5 * buckets + 2):
        calls.clear()
        forward_in_length_buckets(model, model, (TEXTS * 10)[:count], buckets=buckets)
        assert len(calls) == buckets, count
    hook.remove()


SIDED = {"prompts": {"query": "query: ", "document": "passage: "}, "query_max_length": 8, "document_max_length": 16}
LONG_QUERY = "what does the woman with the red umbrella eat in the park with her child on sunday"


def test_an_exported_models_encode_query_and_document_equal_the_training_time_embeddings(tiny_path, tmp_path):
    """model.prompts and the side lengths go into the export as sentence-transformers' own prompts and Transformer
    query/document lengths: encode_query / encode_document of the exported folder give the embeddings the training
    step computed for query-side and document-side texts (training.kinds' pairs: text1 asks, text2 answers)."""
    from sentence_transformers import SentenceTransformer

    from training.kinds import TRAINING_KINDS, BatchContext

    model = build_encoder(tiny_path, dropout=0.0, max_length=32, prompt="s: {text}", **SIDED)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.eval()
    kind = TRAINING_KINDS["pairs"]
    queries, documents = [LONG_QUERY, *TEXTS], TEXTS + ["a child eats in the park"]
    ctx = BatchContext(module=model, model=model, device=torch.device("cpu"), length_buckets=2, sides=kind.sides)
    rows = {"text1": np.array(queries, dtype=object), "text2": np.array(documents, dtype=object)}
    assert [side for _, _, side in kind.encode_calls(ctx, rows)] == ["query", "document"]  # a call per side
    with torch.no_grad():
        trained = kind.embed(ctx, rows)
    export_encoder(model, tmp_path / "m")
    st = SentenceTransformer(str(tmp_path / "m"), device="cpu")
    assert st.prompts["query"] == "query: " and st[0].query_length == 8 and st[0].document_length == 16
    np.testing.assert_allclose(st.encode_query(queries), trained["emb1"].numpy(), atol=1e-5)
    np.testing.assert_allclose(st.encode_document(documents), trained["emb2"].numpy(), atol=1e-5)
    np.testing.assert_allclose(st.encode(TEXTS), inference_embeddings(model, TEXTS), atol=1e-5)  # model.prompt
    reloaded = load_encoder(tmp_path / "m")  # raoe's own loader: the same sides
    np.testing.assert_allclose(inference_embeddings(reloaded, queries, side="query"), trained["emb1"].numpy(), atol=1e-5)
    # each side's prompt and length matter: the long query cut at 8 tokens, the documents with their own prefix
    untruncated = build_encoder(tiny_path, dropout=0.0, max_length=32, prompts=SIDED["prompts"])
    untruncated.load_state_dict(model.state_dict())
    cut = inference_embeddings(model, [LONG_QUERY], side="query")
    assert not np.allclose(cut, inference_embeddings(untruncated, [LONG_QUERY], side="query"), atol=1e-3)
    assert not np.allclose(inference_embeddings(model, TEXTS, side="document"), inference_embeddings(model, TEXTS),
                           atol=1e-3)


def test_symmetric_data_and_no_prompts_encode_every_text_in_one_call(tiny_path):
    """STS pairs have no sides, and without model.prompts or side lengths the sides encode alike: one call (one set of
    forward passes, as before)."""
    from training.kinds import TRAINING_KINDS, BatchContext

    rows = {"text1": np.array(TEXTS, dtype=object), "text2": np.array(TEXTS, dtype=object)}
    sided = build_encoder(tiny_path, **SIDED)
    plain = build_encoder(tiny_path)
    for kind, model, calls in (("sts", sided, [None]), ("pairs", plain, ["query"]), ("pairs", sided, ["query", "document"])):
        ctx = BatchContext(module=model, model=model, device=torch.device("cpu"), sides=TRAINING_KINDS[kind].sides)
        assert [side for _, _, side in TRAINING_KINDS[kind].encode_calls(ctx, rows)] == calls, kind


def test_prompts_are_sentence_transformers_prefixes():
    from pydantic import ValidationError

    from jobconfig.schema import ModelConfig

    with pytest.raises(ValidationError, match="prompts.query is a prefix"):
        ModelConfig(prompts={"query": "query: {text}"})
    with pytest.raises(ValidationError, match="export's name for model.prompt"):
        ModelConfig(prompts={"sentence": "s: "})


def test_a_hub_models_own_prompts_are_used_by_raoes_loader(tiny_path, tmp_path):
    """A sentence-transformers model raoe did not train (no raoe_encoder.json), shipping its own prompts as E5 and BGE
    do: evaluation and mining encode its queries and documents as its encode_query / encode_document do."""
    from sentence_transformers import SentenceTransformer

    model = build_encoder(tiny_path, dropout=0.0)
    model.prompts, model.default_prompt_name = {"query": "query: ", "document": "", "sts": "sts: "}, "sts"
    model.save(str(tmp_path / "hub"))  # sentence-transformers' own save: no raoe metadata
    st, loaded = SentenceTransformer(str(tmp_path / "hub"), device="cpu"), load_encoder(tmp_path / "hub")
    np.testing.assert_allclose(inference_embeddings(loaded, TEXTS, side="query"), st.encode_query(TEXTS), atol=1e-5)
    np.testing.assert_allclose(inference_embeddings(loaded, TEXTS, side="document"), st.encode_document(TEXTS),
                               atol=1e-5)
    np.testing.assert_allclose(inference_embeddings(loaded, TEXTS), st.encode(TEXTS), atol=1e-5)
    assert not np.allclose(st.encode_query(TEXTS), st.encode(TEXTS), atol=1e-3)


def test_a_sources_own_prompts_replace_the_models_for_its_texts(tiny_path):
    """data.sources[].prompts: a source's batches encode with its prompts (an instruction per task), through the
    same tokenisation ahead of the step, while the model keeps model.prompts for export."""
    from training.kinds import TRAINING_KINDS, BatchContext

    model = build_encoder(tiny_path, dropout=0.0, **SIDED).eval()
    instructed = {"query": "Instruct: find the answer\nQuery: ", "document": ""}
    reference = build_encoder(tiny_path, dropout=0.0, query_max_length=8, document_max_length=16,
                              prompts=instructed).eval()
    reference.load_state_dict(model.state_dict())
    kind = TRAINING_KINDS["pairs"]
    rows = {"text1": np.array(TEXTS, dtype=object), "text2": np.array(TEXTS, dtype=object)}
    ctx = BatchContext(module=model, model=model, device=torch.device("cpu"), sides=kind.sides, prompts=instructed)
    ctx.tokens.use(ctx.tokenized(kind.encode_calls(ctx, rows)))
    with torch.no_grad():
        got = kind.embed(ctx, rows)
    assert ctx.tokens.misses == 0
    np.testing.assert_allclose(got["emb1"].numpy(), inference_embeddings(reference, TEXTS, side="query"), atol=1e-5)
    np.testing.assert_allclose(got["emb2"].numpy(), inference_embeddings(reference, TEXTS, side="document"),
                               atol=1e-5)
    assert not np.allclose(got["emb1"].numpy(), inference_embeddings(model, TEXTS, side="query"), atol=1e-3)
    assert model.encoder_settings.prompts == SIDED["prompts"]
