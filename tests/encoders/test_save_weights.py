"""A model cache built on a rank other than 0 still holds the model: transformers 5 skips ``save_pretrained`` there."""

import pytest


def test_a_rank_one_build_writes_config_and_weights(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel
    from transformers.distributed import mixin

    from encoders.cache import save_weights

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)  # as in a worker of a gloo group
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(config).save_pretrained(tmp_path / "plain")
    if (tmp_path / "plain" / "config.json").exists():
        pytest.fail("transformers saved on rank 1: the guard in save_weights may be obsolete, keep the test honest")
    save_weights(BertModel(config), tmp_path / "ours")
    assert (tmp_path / "ours" / "config.json").exists() and (tmp_path / "ours" / "model.safetensors").exists()


def test_building_a_tiny_model_leaves_the_callers_random_state_alone(tmp_path, monkeypatch):
    """A worker that builds the cache and one that finds it must draw the same numbers next (LoRA initialisation)."""
    import torch

    from encoders.tiny import build_tiny_model

    monkeypatch.setenv("RAOE_CACHE", str(tmp_path))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_tiny_model("bert")
    assert torch.equal(torch.rand(3), expected)
