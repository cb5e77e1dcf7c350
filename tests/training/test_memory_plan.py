"""The memory planner: its LoRA count equals PEFT's, and its plans move the right way with memory and GPUs."""

import pytest

from encoders.memory_plan import ARCHS, Arch, lora_params, plan


def test_lora_count_matches_peft_on_a_real_model():
    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source

    path = resolve_model_source("tiny:qwen2")
    model = build_encoder(path, pooling="last_token", lora={"r": 8, "alpha": 16, "dropout": 0.0,
                                                              "target_modules": "all-linear"})
    config = model[0].auto_model.config
    arch = Arch(0, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                config.num_key_value_heads, config.intermediate_size, config.vocab_size)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == lora_params(arch, 8)


def test_plans_for_the_7b_recipe():
    a100 = plan("qwen2.5-7b", quantization="nf4", lora_r=16, seq_len=64, gpu_gb=80, gpus=4, global_batch=512)
    rtx = plan("qwen2.5-7b", quantization="nf4", lora_r=16, seq_len=64, gpu_gb=24, gpus=1, global_batch=512)
    assert a100.fits and rtx.fits
    embedding = 152064 * 3584  # not quantised (fp32 after PEFT's k-bit preparation); no LM head in an encoder
    assert a100.base_weights_gb == pytest.approx(((7.62e9 - 2 * embedding) * 4.127 / 8 + 4 * embedding) / 1e9, abs=0.01)
    assert a100.micro_batch_per_gpu * 4 * a100.grad_accum == 512
    assert rtx.micro_batch_per_gpu * rtx.grad_accum == 512 and rtx.grad_accum >= a100.grad_accum
    bf16 = plan("qwen2.5-7b", quantization="none", lora_r=16, seq_len=64, gpu_gb=24, gpus=1)
    assert bf16.micro_batch_per_gpu < rtx.micro_batch_per_gpu  # 15 GB of bf16 weights leave less for activations
    full = plan("qwen2.5-7b", quantization="none", lora_r=None, seq_len=64, gpu_gb=24, gpus=1)
    assert not full.fits  # full fine-tuning: 16 bytes per parameter of weights, grads and AdamW states
    assert set(ARCHS) >= {"qwen2.5-7b", "bert-base", "modernbert-base", "smollm2-135m"}
