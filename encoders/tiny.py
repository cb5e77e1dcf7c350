"""Tiny random-initialised models with a tokenizer built locally, for tests and tiny configs (and one tiny causal LM
fitted for a few seconds so that it writes whole sentences)."""

from __future__ import annotations

import string
from pathlib import Path

from encoders.cache import ModelSourceError, building, cache_root, save_weights

WORDS = (
    "a an the of to in on at for with by from and or but not no is are was were be been has have had do does "
    "did this that these those it its he she they we you i my his her their our man woman men women boy girl "
    "child children people person dog cat animal water street car bike ball food table city house room road "
    "sits sitting stands standing walks walking runs running plays playing eats eating rides riding looks "
    "looking wearing holding outside inside near down up two three one some many all while young old small "
    "large big red blue green white black shirt hat group crowd game music field beach snow park sleeping"
).split()


# The tiny writer answers this prompt (the last line of the ranking-sentences paper's prompt) with a sentence + EOS.
WRITER_PROMPT = "Write a sentence that is entailment with:{sentence}\nResult:"
SUBJECTS = ("a child", "the group", "a girl", "a man", "a boy", "two people", "a woman", "a dog")
ACTIVITIES = ("is playing music", "is eating food", "is riding a bike", "is walking down the street",
              "is running in the park", "is sitting near the water", "is holding a ball", "is looking at the city")
PLACES = ("", " outside", " in the snow", " on the beach", " while wearing a red hat", " with a big black dog")


def _vocab() -> list[str]:
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    pieces = ["##" + c for c in string.ascii_lowercase + string.digits]
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *pieces, *WORDS]


def _byte_level_bpe(folder: Path) -> int:
    """A small byte-level BPE tokenizer (the kind Qwen2's tokenizer class reads), trained deterministically on
    sentences from the tiny vocabulary; transformers picks the tokenizer class from the model type."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import Qwen2TokenizerFast

    corpus = [" ".join(WORDS[i:i + 8]) for i in range(0, len(WORDS), 3)] + WORDS
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=600, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(folder))
    tokenizer = Qwen2TokenizerFast(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def writer_pairs() -> list[tuple[str, str]]:
    """(sentence, answer) pairs the tiny writer is fitted on: the answer keeps the subject and the place and moves the
    activity one on, so a list of its sentences drifts from the seed step by step (and needs 8 steps to repeat)."""
    return [(f"{s} {ACTIVITIES[a]}{p}.", f" {s} {ACTIVITIES[(a + 1) % len(ACTIVITIES)]}{p}.")
            for s in SUBJECTS for a in range(len(ACTIVITIES)) for p in PLACES]


def _fit_writer(model, tokenizer, steps: int = 120, batch: int = 32) -> None:
    """AdamW on WRITER_PROMPT -> answer + EOS, loss on the answer only (right padding). A random causal LM never
    ends a sentence, so a smoke run of the list generator on it writes no list."""
    import torch

    rows = []
    for sentence, answer in writer_pairs():
        prompt = tokenizer(WRITER_PROMPT.replace("{sentence}", sentence), add_special_tokens=False)["input_ids"]
        target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [model.config.eos_token_id]
        rows.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in rows])
    labels = torch.tensor([t + [-100] * (width - len(t)) for _, t in rows])
    mask = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in rows])[:, None]).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    picks = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        picked = torch.randint(len(rows), (batch,), generator=picks)
        model(input_ids=ids[picked], attention_mask=mask[picked], labels=labels[picked]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_tiny_model(kind: str = "bert") -> Path:
    """Build (once, deterministically) a tiny model under the raoe cache and return its folder."""
    # two random BERTs (e.g. two tiny teachers), a causal-LM backbone, a masked LM (SAN), a causal LM with its head,
    # and that causal LM fitted to answer WRITER_PROMPT with a sentence (ranked lists)
    seeds = {"bert": 0, "bert-alt": 1, "qwen2": 2, "bert-mlm": 3, "qwen2-lm": 4, "qwen2-writer": 5}
    if kind not in seeds:
        raise ModelSourceError(f"unknown tiny model 'tiny:{kind}'; known: {['tiny:' + k for k in seeds]}")
    target = cache_root() / "models" / f"tiny-{kind}-v3"  # v3: never a rank-1 build without weights (save_weights)
    if (target / ".complete").exists():
        return target
    import torch
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        BertModel,
        BertTokenizer,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2Model,
    )

    # fork_rng: building (on whichever process finds no cache) must not move the caller's random state, or what a
    # caller seeds next (LoRA adapters) would depend on whether the model was cached
    with torch.random.fork_rng(), building(target) as staging:
        # transformers 5 takes the vocabulary itself (a vocab_file argument is ignored: every word became [UNK])
        vocab = {w: i for i, w in enumerate(dict.fromkeys(_vocab()))}
        BertTokenizer(vocab=vocab, do_lower_case=True).save_pretrained(staging)
        torch.manual_seed(seeds[kind])
        if kind.startswith("qwen2"):  # a causal LM for last-token pooling, LoRA and 4-bit tests, and generation
            vocab_size = _byte_level_bpe(staging)
            lm = kind in ("qwen2-lm", "qwen2-writer")
            generation = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0} if lm else {}
            config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                                 **generation)
            model = (Qwen2ForCausalLM if lm else Qwen2Model)(config)
            if kind == "qwen2-writer":
                _fit_writer(model, AutoTokenizer.from_pretrained(staging))
            save_weights(model, staging)
            return target
        config = BertConfig(
            vocab_size=len(_vocab()), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=128,
        )
        save_weights((BertForMaskedLM if kind == "bert-mlm" else BertModel)(config), staging)
    return target
