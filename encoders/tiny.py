"""Tiny random-initialised models with a tokenizer built locally, for tests and tiny configs."""

from __future__ import annotations

import string
from pathlib import Path

WORDS = (
    "a an the of to in on at for with by from and or but not no is are was were be been has have had do does "
    "did this that these those it its he she they we you i my his her their our man woman men women boy girl "
    "child children people person dog cat animal water street car bike ball food table city house room road "
    "sits sitting stands standing walks walking runs running plays playing eats eating rides riding looks "
    "looking wearing holding outside inside near down up two three one some many all while young old small "
    "large big red blue green white black shirt hat group crowd game music field beach snow park sleeping"
).split()


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


def build_tiny_model(kind: str = "bert") -> Path:
    """Build (once, deterministically) a tiny model under the raoe cache and return its folder."""
    from encoders.sources import ModelSourceError, building, cache_root

    # two random BERTs (e.g. two tiny teachers), a causal-LM backbone, a masked LM (SAN) and a causal LM with its head
    seeds = {"bert": 0, "bert-alt": 1, "qwen2": 2, "bert-mlm": 3, "qwen2-lm": 4}
    if kind not in seeds:
        raise ModelSourceError(f"unknown tiny model 'tiny:{kind}'; known: {['tiny:' + k for k in seeds]}")
    target = cache_root() / "models" / f"tiny-{kind}-v2"  # v2: a tokenizer that knows its words
    if (target / ".complete").exists():
        return target
    import torch
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertModel,
        BertTokenizer,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2Model,
    )

    with building(target) as staging:
        # transformers 5 takes the vocabulary itself (a vocab_file argument is ignored: every word became [UNK])
        vocab = {w: i for i, w in enumerate(dict.fromkeys(_vocab()))}
        BertTokenizer(vocab=vocab, do_lower_case=True).save_pretrained(staging)
        torch.manual_seed(seeds[kind])
        if kind.startswith("qwen2"):  # a causal LM for last-token pooling, LoRA and 4-bit tests, and generation
            vocab_size = _byte_level_bpe(staging)
            generation = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0} if kind == "qwen2-lm" else {}
            config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                                 **generation)
            (Qwen2ForCausalLM if kind == "qwen2-lm" else Qwen2Model)(config).save_pretrained(staging)
            return target
        config = BertConfig(
            vocab_size=len(_vocab()), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=128,
        )
        (BertForMaskedLM if kind == "bert-mlm" else BertModel)(config).save_pretrained(staging)
    return target
