"""A model card (README.md) for every exported model, as sentence-transformers writes one: what it was trained
from, on what, with which objective and citations, what it scored, and how to load it."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from encoders.model_files import MODEL_CARD

CARD = MODEL_CARD


def _prompt_lines(model) -> list[str]:
    """The named prompts and side lengths, as sentence-transformers applies them (encode_query / encode_document)."""
    lengths = {"query": model.query_max_length, "document": model.document_max_length}
    named = [f"{name} `{prefix}`" + (f" (at most {lengths[name]} tokens)" if lengths.get(name) else "")
             for name, prefix in model.prompts.items()]
    named += [f"{side} texts at most {n} tokens" for side, n in lengths.items() if n and side not in model.prompts]
    if not named:
        return []
    return ["- Prompts: " + "; ".join(named) + " (sentence-transformers' `encode_query` / `encode_document` apply "
            "them)"]


def _version() -> str:
    try:
        return importlib.metadata.version("raoe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def model_card(cfg, result: dict[str, Any], described_objective: dict[str, dict], unit: str) -> str:
    """The card's Markdown from a training job's config, its JSON-line payload and the objective's description."""
    metrics = result.get("metrics", {})
    plan = result.get("plan", {})
    dev = metrics.get("best_stsb_dev_spearman")
    retrieval_dev = metrics.get("best_dev_ndcg_at_10")
    sources = [cfg.data.train] if cfg.data.train else []
    sources += [s.train for s in getattr(cfg.data, "sources", [])]
    lines = [
        f"# {result.get('registered_model') or 'raoe model'}: {result['run_name']}", "",
        f"A sentence-embedding model trained by raoe {_version()} (`{cfg.stage}` job).", "",
        "## Training", "",
        f"- Base model: `{result.get('start_model')}`; pooling `{cfg.model.pooling}`, max length {cfg.model.max_length}"
        + (f", prompt `{cfg.model.prompt}`" if cfg.model.prompt else "")
        + (f", LoRA r={cfg.model.lora.r} on a {cfg.model.quantization} base" if cfg.model.lora else ""),
        *_prompt_lines(cfg.model),
        *([f"- Matryoshka: trained at {', '.join(map(str, cfg.objective.matryoshka.dims))} dimensions (the first d "
           f"of each embedding, renormalised: `SentenceTransformer(path, truncate_dim=d)`)"]
          if getattr(cfg.objective, "matryoshka", None) else []),
        f"- Data: {', '.join(f'`{s}`' for s in sources)}; {result.get('rows_written')} of {result.get('rows_in')} "
        f"records valid ({result.get('rows_quarantined')} quarantined); {plan.get('rows')} {unit} trained on",
        f"- Steps: {metrics.get('steps')} of {plan.get('global_batch')} {unit} ({_workers(result.get('num_workers'))}, "
        f"{result.get('strategy')}), lr {cfg.trainer.lr}, seed {cfg.trainer.seed}; best step {metrics.get('best_step')}",
        (f"- Retrieval dev nDCG@10 x100 of the kept checkpoint (`{cfg.eval.dev_retrieval.task_name}`, which selected "
         f"it): {retrieval_dev:.2f}" if retrieval_dev is not None else
         f"- STS-B dev Spearman x100 of the kept checkpoint: {'not evaluated' if dev is None else f'{dev:.2f}'}"),
        "", "## Objective", "", "| objective | weight | parameters | paper |", "|---|---|---|---|",
        *[f"| {name} ({d['summary']}) | {d['weight']} | {d['params']} | {d['citation']} |"
          for name, d in described_objective.items()],
    ]
    if result.get("relations"):
        lines += ["", "## Relations", "", "Training triples per relation: "
                  + ", ".join(f"{k} {v}" for k, v in result["relations"].items()) + "."]
        prediction = result.get("relation_prediction") or {}
        if prediction:
            lines += ["", "| relation | MRR | Hits@1 | Hits@3 | Hits@10 |", "|---|---|---|---|---|",
                      *[f"| {r} | {v['mrr']:.3f} | {v['hits@1']:.3f} | {v['hits@3']:.3f} | {v['hits@10']:.3f} |"
                        for r, v in prediction.items()]]
    bibtex = dict.fromkeys(entry for d in described_objective.values() for entry in d["bibtex"])  # once each
    lines += ["", "## Citations", "", "```bibtex", *"\n\n".join(bibtex).splitlines(), "```"]
    uri = result.get("model_uri") or result.get("model_path")
    lines += [
        "", "## Loading", "", "```python",
        "from sentence_transformers import SentenceTransformer",
        f'model = SentenceTransformer("{result.get("model_path")}")  # plain embeddings',
        "# as training ran it (a prompt template, a 4-bit/8-bit base under LoRA):",
        "from encoders.backbone import load_encoder",
        f'model = load_encoder("{result.get("model_path")}")',
    ]
    if result.get("relations"):
        lines += ["# relation scores, cos(h_a + r, h_b):", "from encoders.relational import RelationalEncoder",
                  f'RelationalEncoder("{uri}").score(["a man plays"], ["someone plays music"], relation="entailment")']
    registered = result.get("registered_model")
    lines += ["```", "", f"MLflow: run `{result.get('run_id')}`"
              + (f", registered as `{registered}` (`models:/{registered}/<version>`)" if registered else "") + ".", ""]
    return "\n".join(lines)


def write_model_card(folder: str | Path, text: str) -> Path:
    path = Path(folder) / CARD
    path.write_text(text, encoding="utf-8")
    return path


def _workers(count) -> str:
    """trainer.num_workers as a reader says it (0: one worker, the job's own process)."""
    return "1 worker, in the job's process" if count == 0 else f"{count} worker(s)"
