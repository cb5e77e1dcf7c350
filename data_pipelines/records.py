"""Record schemas and validation. Every raw record either becomes a typed row or a bad record with its
source file, line number and reason: nothing is silently dropped or coerced."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}
LABEL_NAMES = {v: k for k, v in LABELS.items()}
NO_LABEL = -1

class RecordError(ValueError):
    """One field of one record is wrong; the message says which and why."""


@dataclass
class BadRecord:
    source: str
    line: int
    reason: str
    raw: str

    def describe(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}"


def text_field(record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    if value is None:
        raise RecordError(f"missing field {key!r}")
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} must be text, got {type(value).__name__}")
    if not value.strip():
        raise RecordError(f"field {key!r} is empty")
    return value


def sentence_text(value: Any, key: str = "text") -> str:
    """A sentence: text with at least one letter or digit (a line of only punctuation is no sentence)."""
    text = text_field({key: value}, key)
    if not any(ch.isalnum() for ch in text):
        raise RecordError(f"field {key!r} holds only punctuation or symbols: {text.strip()[:40]!r}")
    return text


def sentence_record(record: dict[str, Any]) -> dict[str, Any]:
    """{text, negative?} -> a SENTENCES row; a negative (SAN) must be a sentence that differs from its anchor."""
    text = sentence_text(record.get("text"))
    negative = record.get("negative")
    if negative is not None:
        negative = sentence_text(negative, "negative")
        if negative.strip() == text.strip():
            raise RecordError("field 'negative' equals the sentence itself")
    return {"text": text, "negative": negative}


def normalise_label(value: Any) -> int:
    """entailment/neutral/contradiction (any case) or 0/1/2 -> 0/1/2; anything else is an error."""
    if isinstance(value, bool):
        raise RecordError(f"unknown label {value!r}; allowed: entailment, neutral, contradiction or 0, 1, 2")
    if isinstance(value, int) and value in LABEL_NAMES:
        return value
    if isinstance(value, float) and value.is_integer() and int(value) in LABEL_NAMES:
        return int(value)
    if isinstance(value, str):
        key = value.strip().lower()
        if key in LABELS:
            return LABELS[key]
        if key in {"0", "1", "2"}:
            return int(key)
    raise RecordError(f"unknown label {value!r}; allowed: entailment, neutral, contradiction or 0, 1, 2")


def unit_score(value: Any, key: str = "similarity") -> float:
    """A number in [0, 1] (strings holding a number are read as such)."""
    if isinstance(value, bool) or value is None:
        raise RecordError(f"field {key!r} must be a number in [0, 1], got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RecordError(f"field {key!r} must be a number in [0, 1], got {value!r}") from None
    if not math.isfinite(number) or not 0.0 <= number <= 1.0:
        raise RecordError(f"field {key!r} must be a number in [0, 1], got {value!r}")
    return number


def pair_record(record: dict[str, Any], *, label_required: bool = True) -> dict[str, Any]:
    """RAOE enhanced format {text1, text2, label, similarity?} -> a PAIRS row (similarity NaN when absent)."""
    if "label" not in record or record["label"] is None:
        if label_required:
            raise RecordError("missing field 'label'")
        label = NO_LABEL
    else:
        label = normalise_label(record["label"])
    similarity = record.get("similarity")
    return {
        "text1": text_field(record, "text1"),
        "text2": text_field(record, "text2"),
        "label": label,
        "similarity": math.nan if similarity is None else unit_score(similarity),
    }


def sts_record(text1: Any, text2: Any, score: Any, *, scale: float = 5.0) -> dict[str, Any]:
    """STS pair with a gold score in [0, scale]; similarity = score / scale (DESIGN: S in [0, 1])."""
    try:
        value = float(score)
    except (TypeError, ValueError):
        raise RecordError(f"score must be a number in [0, {scale:g}], got {score!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= scale:
        raise RecordError(f"score must be a number in [0, {scale:g}], got {score!r}")
    row = {"text1": text1, "text2": text2}
    return {"text1": text_field(row, "text1"), "text2": text_field(row, "text2"), "score": value,
            "similarity": value / scale}


TRIPLET_NAMES = {"text1": ("text1", "query", "anchor"), "text2": ("text2", "positive"), "negative": ("negative",)}


def triplet_record(record: dict[str, Any]) -> dict[str, Any]:
    """{text1, text2, negative?} (or {query | anchor, positive, negative?}) -> a TRIPLETS row: a query, a relevant
    text and an optional hard negative that must differ from the positive (mining writes these; mining reads the
    same rows without negatives). Its label is entailment: the pair is a positive."""
    def field(name: str) -> Any:
        return next((record[k] for k in TRIPLET_NAMES[name] if record.get(k) is not None), None)

    text1 = text_field({"text1": field("text1")}, "text1")
    text2 = text_field({"text2": field("text2")}, "text2")
    negative = field("negative")
    if negative is not None:
        negative = text_field({"negative": negative}, "negative")
        if negative.strip() == text2.strip():
            raise RecordError("field 'negative' equals the positive (text2)")
    return {"text1": text1, "text2": text2, "text_neg": negative, "label": LABELS["entailment"],
            "similarity": math.nan}


def triple_record(record: dict[str, Any]) -> dict[str, Any]:
    """{head, tail, relation?, negative?} -> a TRIPLES row (RSE): head and tail sentences related by ``relation``
    (any name; a row without one takes its source's ``relation``); an optional in-relation hard negative that must
    differ from the tail."""
    head, tail = sentence_text(record.get("head"), "head"), sentence_text(record.get("tail"), "tail")
    relation = text_field(record, "relation").strip() if record.get("relation") is not None else None
    negative = record.get("negative")
    if negative is not None:
        negative = sentence_text(negative, "negative")
        if negative.strip() == tail.strip():
            raise RecordError("field 'negative' equals the tail (the positive itself)")
    return {"head": head, "tail": tail, "relation": relation, "negative": negative}



GROUP_NAMES = {"query": ("query", "anchor", "text1"), "positives": ("positives", "pos", "positive_passages"),
               "negatives": ("negatives", "neg", "negative_passages"),
               "positive_scores": ("positive_scores", "pos_scores"), "negative_scores": ("negative_scores", "neg_scores")}


def _passage(value: Any, where: str) -> str:
    """A group's text: a string, or a passage {title?, text} (tevatron, BEIR) as "title text"."""
    if isinstance(value, dict):
        text = text_field(value, "text") if "text" in value else text_field({where: None}, where)
        title = value.get("title")
        return f"{title} {text}".strip() if isinstance(title, str) and title.strip() else text
    return text_field({where: value}, where)


def _named(record: dict[str, Any], name: str) -> tuple[str, Any]:
    return next(((k, record[k]) for k in GROUP_NAMES[name] if record.get(k) is not None), (GROUP_NAMES[name][0], None))


def _texts(record: dict[str, Any], name: str, required: bool) -> tuple[str, list[str]]:
    key, value = _named(record, name)
    if value is None and name == "positives" and record.get("positive") is not None:
        key, value = "positive", [record["positive"]]
    if value is None:
        if required:
            raise RecordError(f"missing field {key!r} (a list of texts)")
        return key, []
    if not isinstance(value, list):
        raise RecordError(f"field {key!r} must be a list of texts, got {type(value).__name__}")
    if required and not value:
        raise RecordError(f"field {key!r} is empty: a group needs at least one")
    return key, [_passage(v, f"{key}[{i}]") for i, v in enumerate(value)]


def _scores(record: dict[str, Any], name: str, count: int, of: str) -> list[float] | None:
    """Teacher scores of a group's texts (distillation): one finite number per text, or none at all."""
    key, value = _named(record, name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count:
        raise RecordError(f"field {key!r} must be a list of {count} numbers, one per text of {of!r}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RecordError(f"field {key!r}[{i}] must be a finite number, got {v!r}")
        out.append(float(v))
    return out


def group_record(record: dict[str, Any]) -> dict[str, Any]:
    """{query, positives: [...], negatives: [...]} -> a GROUPS row: a query, one or more texts that answer it and
    any number of hard negatives (FlagEmbedding's {query, pos, neg} and tevatron's passages {title, text} too), with
    optional teacher scores per text (positive_scores / negative_scores, FlagEmbedding's pos_scores / neg_scores). A
    negative that is one of the query's positives is an error."""
    query_key, query = _named(record, "query")
    query = text_field({query_key: query}, query_key)
    positives_key, positives = _texts(record, "positives", required=True)
    negatives_key, negatives = _texts(record, "negatives", required=False)
    answers = {p.strip() for p in positives}
    for i, negative in enumerate(negatives):
        if negative.strip() in answers:
            raise RecordError(f"{negatives_key}[{i}] is also one of the query's positives ({positives_key})")
    return {"query": query, "positives": positives, "negatives": negatives,
            "positive_scores": _scores(record, "positive_scores", len(positives), positives_key),
            "negative_scores": _scores(record, "negative_scores", len(negatives), negatives_key)}
