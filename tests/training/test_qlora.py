"""QLoRA on a tiny random causal LM: 4-bit base, LoRA-only training, adapter export/reload, last-token pooling."""

from pathlib import Path

import numpy as np
import pytest
import torch

from encoders.backbone import build_encoder, export_encoder, forward_pass, inference_embeddings, load_encoder
from encoders.sources import resolve_model_source
from training.kinds import TRAINING_KINDS

PAIRS = TRAINING_KINDS["pairs"]  # its build(): a micro-batch as one chunk

LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
PROMPT = "Summarize sentence {text} in one word:"
TEXTS = ["a man is playing music.", "two dogs run", "the woman is eating food in the park with a child",
         "a girl rides a bike"]


@pytest.fixture(scope="module")
def qwen_path():
    return resolve_model_source("tiny:qwen2")

FIELDS = ("scores", "labels")  # gathered from the rows beside the embeddings


def qlora(path, padding_side="left", prompt=PROMPT):
    torch.manual_seed(0)
    return build_encoder(path, pooling="last_token", prompt=prompt, quantization="nf4", lora=LORA,
                         padding_side=padding_side, max_length=48)


def _batch():
    from data_pipelines.records import normalise_label

    # No prompt and no final period here: a tiny random causal LM's last-token state is mostly its own token's
    # embedding, so texts must end in different words for the cosines to differ (a 7B model reads the context).
    rows = [("a man sits", "a man is sitting", "entailment", 0.9), ("a man sits", "a man sits in a park",
            "neutral", 0.5), ("a man sits", "a woman runs", "contradiction", 0.1),
            ("two dogs play", "dogs are playing", "entailment", 0.85), ("two dogs play", "two cats sleep",
            "contradiction", 0.15), ("a child eats", "a child eats food at home", "neutral", 0.55)]
    return {"text1": np.array([r[0] for r in rows], dtype=object), "text2": np.array([r[1] for r in rows], dtype=object),
            "label": np.array([normalise_label(r[2]) for r in rows]), "similarity": np.array([r[3] for r in rows])}


def test_base_is_4bit_and_only_lora_trains(qwen_path):
    import bitsandbytes as bnb

    from objectives.composite import PRESETS, CompositeObjective
    from training.kinds import BatchContext

    model = qlora(qwen_path, prompt=None)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) >= 14  # every linear of the 2 blocks
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    objective, losses = CompositeObjective(PRESETS["raoe"], {"rank_margin": {"margin": 0.0}}), []
    model.train()
    for _ in range(6):  # a fixed batch: the loss must go down
        loss, _ = objective(PAIRS.build(BatchContext(model, model, torch.device("cpu"), fields=FIELDS), _batch()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)  # the 4-bit base and its quant state are untouched


def test_saved_adapter_reloads_with_equal_embeddings(qwen_path, tmp_path):
    import json

    model = qlora(qwen_path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))  # a trained adapter, not the zero-initialised one
    trained = inference_embeddings(model, TEXTS)
    export_encoder(model, tmp_path / "m")
    files = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    assert json.loads((tmp_path / "m" / "raoe_encoder.json").read_text())["quantization"] == "nf4"
    reloaded = load_encoder(tmp_path / "m")
    np.testing.assert_allclose(inference_embeddings(reloaded, TEXTS), trained, atol=1e-5)
    base_only = inference_embeddings(qlora(qwen_path), TEXTS)
    assert not np.allclose(base_only, trained, atol=1e-3)


@pytest.mark.parametrize("side", ["left", "right"])
def test_last_token_pooling_picks_the_last_real_token(qwen_path, side):
    model = build_encoder(qwen_path, pooling="last_token", padding_side=side, dropout=0.0)
    model.eval()
    features = model.preprocess(TEXTS)
    mask = features["attention_mask"]
    assert (mask[:, 0] == 0).any() if side == "left" else (mask[:, -1] == 0).any()  # there is padding
    with torch.no_grad():
        hidden = model[0].auto_model(input_ids=features["input_ids"], attention_mask=mask).last_hidden_state
        pooled = forward_pass(model, model, TEXTS)
    last = [int(torch.nonzero(row).max()) for row in mask]
    expected = torch.stack([hidden[i, j] for i, j in enumerate(last)])
    assert torch.allclose(pooled, expected, atol=1e-5)
    if side == "right":  # causal attention: right padding leaves each text's states as if it were alone
        with torch.no_grad():
            alone = torch.cat([forward_pass(model, model, [t]) for t in TEXTS])
        assert torch.allclose(pooled, alone, atol=1e-4)


def _qlora_config(train_env, name, *overrides):
    from jobconfig import load_config
    from jobconfig.schema import TrainJobConfig
    from tests.training.conftest import ROOT, TINY_NLI

    base = {"tracking.run_name": name, "trainer.storage_path": train_env / "runs", "output_dir": train_env / "models",
            "eval.data_dir": train_env / "no-dev-data", "data.train": TINY_NLI, "tracking.experiment": "raoe-test",
            "data.max_rows": 64, "trainer.global_batch_size": 32, "trainer.max_steps": 2, "trainer.eval_every": 2,
            "trainer.warmup_ratio": 0.0, "model.gradient_checkpointing": True, "trainer.length_buckets": 2,
            "data.cache": False}
    return load_config(TrainJobConfig, ROOT / "configs" / "tiny" / "qlora.yaml",
                       [f"{k}={v}" for k, v in base.items()] + list(overrides))


@pytest.fixture(scope="module")
def checkpointed_qlora(train_env):
    """4-bit base + LoRA + gradient checkpointing + 2 length-bucketed forwards per micro-batch: each adapter weight
    is used in two checkpointed segments of one backward (the shipped Qwen2.5-7B recipe's case)."""
    from training.run import run_training

    return {
        "1 worker": run_training(_qlora_config(train_env, "qlora-ckpt-1", "trainer.num_workers=0")),  # in process
        "2 workers ddp": run_training(_qlora_config(train_env, "qlora-ckpt-2", "trainer.num_workers=2")),
    }


def test_checkpointed_qlora_gradients_are_exact_on_two_workers(checkpointed_qlora):
    from tests.training.conftest import metric_by_step

    one, two = checkpointed_qlora["1 worker"], checkpointed_qlora["2 workers ddp"]
    assert one["quantization"] == two["quantization"] == "nf4" and one["metrics"]["steps"] == 2
    for result in (one, two):  # only the adapter is exported
        assert Path(result["model_path"], "adapter_config.json").exists()
        assert not Path(result["model_path"], "model.safetensors").exists()
    for key in ("train_loss", "grad_norm"):
        expected, got = metric_by_step(one["run_id"], key), metric_by_step(two["run_id"], key)
        assert sorted(got) == [1, 2]
        # Step 1 starts from the same weights; step 2 from weights one AdamW step apart by summation order, where a
        # gradient of ~1e-7 can flip the sign Adam moves by (measured: 1.3e-3 relative at step 2 on some rows, as in
        # test_distributed; a wrong batch or a gradient off by x2 moves these by 2-50%).
        assert got[1] == pytest.approx(expected[1], rel=1e-3), f"{key} at step 1"
        assert got[2] == pytest.approx(expected[2], rel=5e-3), f"{key} at step 2"


def test_gradient_checkpointing_is_non_reentrant(qwen_path):
    """Reentrant segments run a backward of their own: a weight used in two of them reaches DDP's hook twice."""
    model = build_encoder(qwen_path, pooling="last_token", quantization="nf4", lora=LORA, gradient_checkpointing=True)
    auto = model[0].auto_model
    assert auto.is_gradient_checkpointing
    funcs = [m._gradient_checkpointing_func for m in auto.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert funcs and all(f.keywords.get("use_reentrant") is False for f in funcs)
