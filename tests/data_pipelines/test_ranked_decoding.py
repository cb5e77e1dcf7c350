"""Directionally controlled decoding: lam = 0 is transformers' greedy generate, batched with left padding; lam > 0
picks argmax of (1 + lam) log p(.|prev) - lam log p(.|prev2) at every step."""

import pytest
import torch

from data_pipelines.ranked import directed_greedy
from encoders.sources import resolve_model_source

PROMPTS = ["a man is playing music", "two dogs", "the woman is eating food in the park with a child"]
OTHER = ["a girl rides a bike", "the city at night is big and old", "a cat"]


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_source("tiny:qwen2-lm")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _generate(model, tokenizer, prompts, n):
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=n, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_lam_zero_is_greedy_generate(lm):
    model, tokenizer = lm
    want = _generate(model, tokenizer, PROMPTS, 12)
    assert directed_greedy(model, tokenizer, PROMPTS, None, lam=0.5, max_new_tokens=12) == want
    assert directed_greedy(model, tokenizer, PROMPTS, OTHER, lam=0.0, max_new_tokens=12) == want


def test_guided_steps_take_the_argmax_of_the_combined_scores(lm):
    model, tokenizer = lm
    lam, n = 1.0, 6
    got = directed_greedy(model, tokenizer, PROMPTS[:1], OTHER[:1], lam=lam, max_new_tokens=n)
    # reference: recompute both conditions from scratch at every step (no cache, no batching)
    a, b = (tokenizer(p, return_tensors="pt", add_special_tokens=False)["input_ids"] for p in (PROMPTS[0], OTHER[0]))
    tokens = []
    with torch.no_grad():
        for _ in range(n):
            la = torch.log_softmax(model(input_ids=a).logits[0, -1], -1)
            lb = torch.log_softmax(model(input_ids=b).logits[0, -1], -1)
            t = int(((1 + lam) * la - lam * lb).argmax())
            tokens.append(t)
            a, b = torch.cat([a, torch.tensor([[t]])], 1), torch.cat([b, torch.tensor([[t]])], 1)
    assert got == [tokenizer.decode(tokens, skip_special_tokens=True)]
    assert got != directed_greedy(model, tokenizer, PROMPTS[:1], None, lam=0, max_new_tokens=n)
