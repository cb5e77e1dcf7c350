"""The names of the files raoe writes beside an exported sentence-transformers folder: what resolving, downloading
and describing a model needs, without torch (a job's driver reads and checks its corpus before it loads torch)."""

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
