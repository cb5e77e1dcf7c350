"""The names of the files raoe writes beside an exported sentence-transformers folder: what resolving, downloading
and describing a model needs, without torch (a job's driver reads and checks its corpus before it loads torch)."""

import json
from pathlib import Path

RAOE_META = "raoe_encoder.json"  # raoe's settings on every model it builds or loads
MODEL_CARD = "README.md"  # the model card beside the weights (tracking.model_card writes it)
RELATIONS_JSON = "relations.json"  # an RSE model's relation names
RELATIONS_WEIGHTS = "relations.safetensors"  # and its relation vectors
TABLE = "relation_vectors"  # the relation table's parameter name on the training model
# The export's sentence-transformers name of model.prompt (its default prompt); model.prompts hold the others
# ('query', 'document', ...)
DEFAULT_PROMPT_NAME = "sentence"
# The sides a text of training data may be on (training.kinds); a text on no side takes model.prompt
SIDES = ("query", "document")


def dense_head_folders(model_path: str) -> list[Path]:
    """The folders of the Dense modules after pooling that a sentence-transformers folder lists in its modules.json
    (a rotation from ray_jobs/rotate.py, a projection head); none for a bare backbone or a hub id."""
    listed = Path(model_path) / "modules.json"
    if not listed.is_file():
        return []
    folders, pooled = [], False
    for entry in json.loads(listed.read_text()):
        kind = entry.get("type", "").rsplit(".", 1)[-1]
        pooled = pooled or kind == "Pooling"
        if pooled and kind == "Dense":
            folders.append(Path(model_path) / entry["path"])
    return folders


def refuse_adapters_on_heads(model_path: str, lora: bool, quantization: str) -> None:
    """LoRA or quantised training of a model with a Dense head is refused, by key: the base is frozen and only
    adapters train, and what its head should do then (train in full beside them, or stay frozen) is not built."""
    if (lora or quantization != "none") and dense_head_folders(model_path):
        raise ValueError(f"model.lora / model.quantization: {model_path} has a Dense module after pooling (a "
                         f"rotation or projection head), and adapter training of such a model is not supported: "
                         f"train it in full (model.lora: null, model.quantization: none)")
