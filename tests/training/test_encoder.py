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
