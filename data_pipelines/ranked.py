"""Directionally controlled decoding for ranked sentence lists (ranking-sentences.txt, Sec. 3.1, Eq. 3-4).

Sentence x(k) is generated from the prompt holding x(k-1), pushed away from the prompt holding x(k-2): at every
step the next token is the argmax of (1 + lam) * log p(. | prev, generated) - lam * log p(. | prev2, generated).
The paper's "gamma = 1.5" is this guidance scale 1 + lam (classifier-free guidance), so lam defaults to 0.5."""

from __future__ import annotations

import torch


def _prefill(model, tokenizer, prompts: list[str], device):
    """Left-padded prompts through the model once: (last logits, KV cache, attention mask, next positions)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    mask = enc["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=enc["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True)
    return out.logits[:, -1].float(), out.past_key_values, mask, positions[:, -1:] + 1


def _advance(model, token: torch.Tensor, cache, mask: torch.Tensor, position: torch.Tensor):
    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache,
                use_cache=True)
    return out.logits[:, -1].float(), out.past_key_values, mask, position + 1


@torch.no_grad()
def directed_greedy(model, tokenizer, prompts_prev: list[str], prompts_prev2: list[str] | None, *, lam: float = 0.5,
                    max_new_tokens: int = 48) -> list[str]:
    """The continuation of each fully rendered prompt in ``prompts_prev`` (chat template already applied), steered
    away from the matching prompt in ``prompts_prev2``; ``lam = 0`` or ``prompts_prev2 = None`` is plain greedy
    decoding (equal to ``model.generate(do_sample=False)``). Batched (left padding), one KV cache per condition,
    each row stops at its EOS."""
    if prompts_prev2 is not None and len(prompts_prev2) != len(prompts_prev):
        raise ValueError(f"prompts_prev2 has {len(prompts_prev2)} prompts, prompts_prev {len(prompts_prev)}")
    guided = prompts_prev2 is not None and lam != 0
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        prev = _prefill(model, tokenizer, prompts_prev, device)
        prev2 = _prefill(model, tokenizer, prompts_prev2, device) if guided else None
    finally:
        tokenizer.padding_side = side
    eos = {int(t) for t in ([model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id,
                                                                                int) else
                            model.generation_config.eos_token_id or [tokenizer.eos_token_id]) if t is not None}
    pad = tokenizer.pad_token_id
    done = torch.zeros(len(prompts_prev), dtype=torch.bool, device=device)
    generated = []
    for _ in range(max_new_tokens):
        scores = torch.log_softmax(prev[0], dim=-1)
        if guided:
            scores = (1 + lam) * scores - lam * torch.log_softmax(prev2[0], dim=-1)
        token = scores.argmax(dim=-1)
        token = torch.where(done, torch.full_like(token, pad), token)
        generated.append(token)
        done |= torch.isin(token, torch.tensor(sorted(eos), device=device))
        if bool(done.all()):
            break
        prev = _advance(model, token, *prev[1:])
        if guided:
            prev2 = _advance(model, token, *prev2[1:])
    tokens = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in prompts_prev]
    out = []
    for row in tokens:
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        out.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return out
