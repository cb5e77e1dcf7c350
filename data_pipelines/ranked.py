"""Directionally controlled decoding for ranked sentence lists (ranking-sentences.txt, Sec. 3.1, Eq. 3-4).

Sentence x(k) is generated from the prompt holding x(k-1), pushed away from the prompt holding x(k-2): at every
step the next token is the argmax of (1 + lam) * log p(. | prev, generated) - lam * log p(. | prev2, generated).
The paper's "gamma = 1.5" is this guidance scale 1 + lam (classifier-free guidance), so lam defaults to 0.5."""

from __future__ import annotations

import re

import torch

from encoders.devices import actor_device
from encoders.sources import resolve_model_source


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


# The instruction of the paper's method (ranking-sentences, Appendix A "Prompt for our method").
LIST_PROMPT = (
    "Rewrite the following sentence or phrase using different words and sentence structure while preserving its "
    "original meaning. Directly answer with the rewritten sentence. Don't give any explanation or description other "
    "than the rewritten sentence.\nWrite a sentence that is entailment with:{sentence}.\nResult:"
)


def seed_candidates(ds, column: str):
    """The distinct non-empty values of ``column`` (the premises, text1, of NLI pairs in the paper), stripped, as a
    Ray Dataset with one column ``text``: SNLI repeats each premise for its hypotheses. A groupby across the cluster:
    nothing is collected on the driver."""
    def stripped(table):
        import pyarrow as pa
        import pyarrow.compute as pc

        texts = pc.utf8_trim_whitespace(pc.cast(table[column], pa.string()))
        return pa.table({"text": pc.filter(texts, pc.fill_null(pc.greater(pc.utf8_length(texts), 0), False))})

    return ds.select_columns([column]).map_batches(stripped, batch_format="pyarrow").groupby("text").count() \
        .select_columns(["text"])


def kmeans_sample(candidates, limit: int, seed: int):
    """(at most ``limit`` of the candidates, how many there were): all of them, or those with the smallest seeded
    hash of their text (a distributed sort), the same for the same corpus and seed whatever the block order."""
    candidates = candidates.materialize()  # the groupby runs once, for the count and the sample alike
    total = candidates.count()
    if total <= limit:
        return candidates, total

    def keyed(table):
        import hashlib

        import pyarrow as pa

        keys = [int.from_bytes(hashlib.blake2b(f"{seed}\0{t}".encode(), digest_size=8).digest(), "little") >> 1
                for t in table["text"].to_pylist()]
        return table.append_column("key", pa.array(keys, pa.int64()))

    return candidates.map_batches(keyed, batch_format="pyarrow").sort(["key", "text"]).limit(limit) \
        .select_columns(["text"]), total


# rows x clusters^2 up to which k-means runs exactly (scipy's k-means++ start computes i x rows distances for each
# of the clusters i: rows x clusters^2 / 2 in all)
EXACT_KMEANS_WORK = 200_000_000


def kmeans_seeds(embeddings, clusters: int, per_cluster: int, seed: int) -> list[int]:
    """Row indices of diverse seed sentences: k-means (k-means++ init, seeded) over the embeddings, then up to
    ``per_cluster`` members of each cluster drawn with the same seed; sorted, deterministic.

    Exact (scipy) while rows x clusters^2 <= EXACT_KMEANS_WORK; above it, mini-batch k-means (scikit-learn; Sculley,
    "Web-scale k-means clustering", 2010): scipy's k-means++ start alone costs rows x clusters^2 / 2 distance
    evaluations (7.5e10 at 150k SNLI premises and the paper's 1000 clusters)."""
    import numpy as np

    k = min(clusters, len(embeddings))
    exact = len(embeddings) * k * k <= EXACT_KMEANS_WORK
    data = np.asarray(embeddings, dtype=np.float64 if exact else np.float32)
    data = data / np.linalg.norm(data, axis=1, keepdims=True).clip(min=1e-12)
    rng = np.random.default_rng(seed)
    if exact:
        from scipy.cluster.vq import kmeans2

        _, labels = kmeans2(data, k, minit="++", seed=rng)
    else:
        from sklearn.cluster import MiniBatchKMeans

        labels = MiniBatchKMeans(n_clusters=k, init="k-means++", random_state=seed, batch_size=min(4096, len(data)),
                                 n_init=1, max_iter=20).fit(data).labels_
    chosen = []
    for cluster in range(k):
        members = np.flatnonzero(labels == cluster)
        if len(members):
            chosen.extend(rng.choice(members, size=min(per_cluster, len(members)), replace=False).tolist())
    return sorted(chosen)


SENTENCE_END = re.compile(r'[.!?]["\')]?(?=\s|$)')  # ., ! or ? (maybe closing a quote) before a space or the end


def first_sentence(output: str) -> str:
    """The generated sentence: the first line of the output, unquoted, up to its first sentence end (small chat
    models often run on with commentary after the rewrite)."""
    text = output.strip().split("\n")[0].strip()
    if text.startswith('"'):  # a quoted rewrite: the quote is the sentence
        text = text[1:].split('"')[0].strip()
    end = SENTENCE_END.search(text)
    return text[: end.end()] if end else text


def check_sentence(sentence: str, earlier: list[str]) -> str | None:
    """Why a generated sentence must end its list (None: keep it): empty, a repeat of an earlier one, or looping
    (a word four times in a row, or a three-word phrase three times)."""
    words = sentence.lower().split()
    if not words or not any(ch.isalnum() for ch in sentence):
        return "empty"
    def plain(text: str) -> list[str]:  # words only: "packages ." and "packages." are the same sentence
        return "".join(ch if ch.isalnum() else " " for ch in text.lower()).split()

    if plain(sentence) in [plain(e) for e in earlier]:
        return "repeated"
    if any(len(set(words[i:i + 4])) == 1 for i in range(len(words) - 3)):
        return "looping"
    grams = [tuple(words[i:i + 3]) for i in range(len(words) - 2)]
    if grams and max(grams.count(g) for g in set(grams)) >= 3:
        return "looping"
    return None


class ListGenerator:
    """Ray Data actor: one causal LM; for a batch of seed sentences, ``steps`` sentences each by directionally
    controlled decoding (x1 at lam = 0, later ones steered away from the sentence two back), lists stopped early
    at the first sentence that fails ``check_sentence`` or that the token limit cut before its end; of each output
    only its first sentence is kept."""

    def __init__(self, model: str, prompt: str, steps: int, lam: float, max_new_tokens: int, threads: int = 1,
                 trust_remote_code: bool = False, gpus: float = 0.0):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        path = resolve_model_source(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = model.eval().to(actor_device(gpus))  # directed_greedy follows the model's device
        self.prompt, self.steps, self.lam, self.max_new_tokens = prompt, steps, lam, max_new_tokens

    def render(self, sentence: str) -> str:
        message = self.prompt.replace("{sentence}", sentence)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                      add_generation_prompt=True)
        return message

    def generate(self, seeds: list[str]) -> tuple[list[list[str]], list[str | None]]:
        lists, stopped = [[s] for s in seeds], [None] * len(seeds)
        for step in range(self.steps):
            active = [i for i in range(len(seeds)) if stopped[i] is None]
            if not active:
                break
            prev = [self.render(lists[i][-1]) for i in active]
            prev2 = [self.render(lists[i][-2]) for i in active] if step > 0 else None
            outputs = directed_greedy(self.model, self.tokenizer, prev, prev2, lam=self.lam if step > 0 else 0.0,
                                      max_new_tokens=self.max_new_tokens)
            for i, raw in zip(active, outputs):
                text = first_sentence(raw)
                reason = check_sentence(text, lists[i])
                if reason is None and not SENTENCE_END.search(text[-2:]) and self._hit_token_limit(raw):
                    reason = "unfinished"  # cut by max_new_tokens before any sentence end
                if reason is None:
                    lists[i].append(text)
                else:
                    stopped[i] = reason
        return lists, stopped

    def _hit_token_limit(self, output: str) -> bool:
        return len(self.tokenizer(output, add_special_tokens=False)["input_ids"]) >= self.max_new_tokens

    def __call__(self, batch):
        """The batch's other columns (a seed id) come back with each list: Ray Data does not keep row order across
        actors, so the job matches lists by them, not by position."""
        import numpy as np

        lists, stopped = self.generate([str(t) for t in batch["text"]])
        column = np.empty(len(lists), dtype=object)
        for i, sentences in enumerate(lists):
            column[i] = sentences
        carried = {k: v for k, v in batch.items() if k != "text"}
        return {**carried, "sentences": column, "stopped": np.array(stopped, dtype=object)}
