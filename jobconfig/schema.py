"""Typed config sections shared by every job. Unknown keys are errors (extra='forbid')."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from encoders.devices import EncoderPool
from encoders.model_files import DEFAULT_PROMPT_NAME
from objectives.catalog import DEFAULTS, PRESETS
from runtime.paths import stable_path

# An output location that outlives the job (runtime/paths.py): made absolute when the config is loaded.
OutputPath = Annotated[str, AfterValidator(stable_path)]


def _distinct_sizes(dims: list[int]) -> list[int]:
    if any(d < 1 for d in dims) or len(set(dims)) != len(dims):
        raise ValueError(f"must be distinct sizes >= 1, got {dims}")
    return dims


CutSizes = Annotated[list[int], AfterValidator(_distinct_sizes)]  # leading embedding sizes (eval.dims, rotate.dims)
RELATIVE = ("a relative path is made absolute against the working directory, or against RAOE_HOME (~/raoe) when "
            "the job runs in Ray's scratch copy of it (ray job submit --working-dir)")
# Every config section naming a model it loads: transformers runs code shipped with a model only when asked.
TrustRemoteCode = Annotated[bool, Field(description="run Python code shipped with the model folder (its own "
                                        "architecture); off unless set")]

# Every job that writes files: on a cluster of several nodes a plain local path would be written by each task on its
# own node (runtime.local_ray.refuse_node_local_paths) unless every node mounts it at the same path.
SharedFilesystem = Annotated[bool, Field(description="the job's local output paths are on a file system every node "
                                         "mounts at the same path (NFS, EFS, Lustre): allows them on a cluster of "
                                         "several nodes, where they are refused otherwise")]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EncoderPoolSection(Section):
    """The keys of a job that encodes with a Ray Data actor pool (evaluate, promote)."""

    actors: int = Field(1, ge=1, description="encoder actors in the Ray Data pool")
    cpus_per_actor: float = Field(1.0, gt=0, description="CPUs each encoder actor reserves")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs each encoder actor reserves (fractions share one); > 0 "
                                  "encodes on the actor's GPU")

    def encoder_pool(self) -> EncoderPool:
        return EncoderPool(self.actors, self.cpus_per_actor, self.gpus_per_actor)


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="LoRA rank")
    alpha: int = Field(32, ge=1, description="LoRA scaling alpha")
    dropout: float = Field(0.05, ge=0.0, le=1.0, description="dropout on the LoRA path")
    target_modules: list[str] | str = Field("all-linear", description="module names, or 'all-linear' (QLoRA's choice)")


class ModelConfig(Section):
    source: str = Field("pypi:all-minilm-l6-v2", description="HF id, local path, pypi:<package> or tiny:bert")
    pooling: Literal["mean", "cls", "last_token"] = Field("mean", description="how token states become one vector")
    prompt: str | None = Field(None, description="template with {text}, e.g. 'Summarize sentence {text} in one word:'")
    max_length: int = Field(64, ge=8, le=32768, description="tokens per sentence (dynamic padding up to this)")
    prompts: dict[str, str] = Field(default_factory=dict, description="named prompts, prefixes as in "
                                    "sentence-transformers ({'query': 'query: ', 'document': 'passage: '}): a text on "
                                    "a query or document side of its data (docs/training.md) takes that side's prompt "
                                    "instead of model.prompt; exported as the model's sentence-transformers prompts "
                                    "(encode_query / encode_document)")
    query_max_length: int | None = Field(None, ge=8, le=32768, description="tokens per query-side text; null = "
                                         "max_length")
    document_max_length: int | None = Field(None, ge=8, le=32768, description="tokens per document-side text; null = "
                                            "max_length")
    dropout: float | None = Field(None, ge=0.0, le=1.0, description="attention/hidden dropout; null keeps the backbone's")
    init_from: str | None = Field(None, description="start from a trained model: path or models:/name/version|@alias")
    quantization: Literal["none", "nf4", "int8"] = Field("none", description="load the base frozen in 4-bit NF4 or 8-bit")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters only (null: full fine-tuning)")
    padding_side: Literal["left", "right"] | None = Field(None, description="tokenizer padding side; null keeps its own")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward (less memory)")
    negative_dropout: float | None = Field(None, ge=0.0, le=1.0, description="dropout of the aligned negatives' "
                                           "forward pass (SAN's p2, unsupervised job); null = model.dropout")
    trust_remote_code: TrustRemoteCode = Field(False, description="run Python code shipped with the model folder "
                                               "(its own architecture); off unless set, then recorded in the export")

    @field_validator("prompts")
    @classmethod
    def _prefixes(cls, prompts: dict[str, str]) -> dict[str, str]:
        for name, prefix in prompts.items():
            if not name.isidentifier():
                raise ValueError(f"prompt name {name!r} must be a plain name such as query or document")
            if name == DEFAULT_PROMPT_NAME:
                raise ValueError(f"{name!r} is the export's name for model.prompt: set model.prompt instead")
            if "{text}" in prefix:
                raise ValueError(f"prompts.{name} is a prefix put before the text, as in sentence-transformers: "
                                 f"drop '{{text}}' (a template with text after it belongs in model.prompt)")
        return prompts

    def encoder_kwargs(self) -> dict:
        """build_encoder's arguments for how texts are encoded: pooling, prompts, lengths, padding side."""
        return {"pooling": self.pooling, "max_length": self.max_length, "prompt": self.prompt,
                "prompts": dict(self.prompts), "query_max_length": self.query_max_length,
                "document_max_length": self.document_max_length, "padding_side": self.padding_side}


class TrainerConfig(Section):
    num_workers: int | tuple[int, int] = Field(1, description="Ray Train workers; [min, max] trains elastically "
                                               "(DDP): a run that loses workers goes on with fewer, down to min, and "
                                               "grows back towards max when Ray can place them, on the same global "
                                               "batches (exact: see chunk_size); 0 trains in the job's own process "
                                               "(Ray Train's local mode: one worker's run, no worker actor to start, "
                                               "no restarts)")
    strategy: Literal["ddp", "deepspeed"] = Field("ddp", description="DDP (torch backend) or DeepSpeed ZeRO")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage")
    global_batch_size: int = Field(512, ge=1, description="rows (pairs, sentences, lists) per optimizer step over all "
                                   "workers")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step, each its own objective over the "
                            "workers' rows (fewer in-batch negatives: for the exact objective of a large batch, "
                            "use cache_embeddings)")
    chunk_size: int | None = Field(None, ge=1, description="rows per encoder call, cut from each step in its own order, "
                                   "each with its own length buckets and dropout seed: the same chunk size on 1 or N "
                                   "workers trains the same model with dropout on; null = a worker's micro-batch "
                                   "(exact on this worker count only)")
    cache_embeddings: bool = Field(False, description="GradCache: encode the chunks without autograd, take the "
                                   "objective and its gradient on the whole micro-batch, then re-encode one chunk at a "
                                   "time with autograd; memory follows chunk_size, not the batch, for one more forward "
                                   "pass")
    epochs: float = Field(5.0, gt=0, description="passes over the data when max_steps is null")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs")
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.01, ge=0)
    warmup_ratio: float = Field(0.1, ge=0, le=1, description="linear warm-up share of the steps")
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm; null disables")
    bf16: bool = Field(False, description="bf16 autocast of the encoder forward; weights, gradients, checkpoints and "
                       "exports stay fp32 under DDP and DeepSpeed alike")
    length_buckets: int = Field(2, ge=1, description="forward passes per chunk over its texts grouped by length "
                                "(each padded to its own longest text); 1 = one pass")
    seed: int = Field(42, ge=0, description="seeds Python, NumPy, torch and the data order")
    cpus_per_worker: float = Field(0.5, gt=0, description="fractional on CPU so Ray Data readers never starve")
    use_gpu: bool = Field(False)
    eval_every: int = Field(50, ge=1, description="steps between STS-B dev evaluations and checkpoints")
    ready_timeout_s: float = Field(900, gt=0, description="seconds every worker may take, after the first, to load its "
                                   "model and map its corpus rows; a worker later than that is named in the error "
                                   "(else the others wait out the backend's 30-minute collective timeout)")
    max_failures: int = Field(0, ge=-1, description="worker-group restarts from the last checkpoint (-1 = forever)")
    threads_per_worker: int | None = Field(None, ge=1, description="torch threads per worker; null = torch's default")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept: the best by STS-B dev Spearman (the latest "
                                                       "too), or the latest ones when the run has no dev set")
    storage_path: OutputPath = Field("raoe_runs", validate_default=True, description="Ray Train storage for checkpoints "
                                     "(local path, s3://, gs://); relative: see output_dir")

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, workers: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (workers, workers) if isinstance(workers, int) else workers
        if workers == 0:
            return workers
        if low < 1 or high < low:
            raise ValueError("must be a count >= 1, 0 (train in the job's process), or [min, max] with "
                             "1 <= min <= max (elastic)")
        return workers

    @model_validator(mode="after")
    def _elastic_strategy(self) -> "TrainerConfig":
        if self.elastic and self.strategy != "ddp":
            raise ValueError(f"trainer.num_workers {list(self.num_workers)} (elastic) needs trainer.strategy ddp: a "
                             f"DeepSpeed checkpoint's ZeRO partitions belong to one worker count (DeepSpeed's "
                             f"universal checkpoints are not supported here)")
        if self.in_process and self.max_failures != 0:
            raise ValueError(f"trainer.max_failures={self.max_failures} restarts a worker group, and "
                             f"trainer.num_workers=0 trains in the job's own process, which has none: set "
                             f"trainer.max_failures=0, or trainer.num_workers >= 1")
        return self

    @property
    def in_process(self) -> bool:
        """num_workers 0: the training loop runs in the job's own process (training.in_process)."""
        return self.num_workers == 0

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple) and self.num_workers[0] != self.num_workers[1]

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; equal unless elastic; a run in process is one worker's."""
        if isinstance(self.num_workers, int):
            return (max(self.num_workers, 1),) * 2
        return tuple(self.num_workers)


GROUP_FORMATS = ("groups_jsonl", "groups_parquet")
DEFAULT_GROUP_SIZE = 8
DataFormat = Literal["auto", "pairs_jsonl", "snli_jsonl", "senteval_nli", "csv", "parquet", "stsb_csv", "senteval_sts",
                     "txt", "jsonl", "triplets_jsonl", "groups_jsonl", "groups_parquet"]


class SourceConfig(Section):
    """One corpus of a mixed-source training job (data.sources): its own reader, weight, objective and prompts."""

    train: str = Field(description="a file, a folder or hf:<dataset>[:<config>]")
    name: str | None = Field(None, description="its name in progress lines, the JSON line and MLflow (default: the "
                             "file or folder name)")
    format: DataFormat = Field("auto", description="reader, as data.format")
    split: str | None = Field(None, description="split of a folder layout or hf: dataset")
    max_rows: int | None = Field(None, ge=1, description="use only its first N rows")
    shuffle_seed: int | None = Field(None, description="shuffle its rows with this seed before max_rows")
    triplets: bool = Field(False, description="NLI pairs -> SimCSE triplets, as data.triplets")
    group_size: int | None = Field(None, ge=1, description="query groups' texts per query and step, as data.group_size")
    weight: float = Field(1.0, gt=0, description="how often its batches come: each step draws one source with "
                          "probability weight / sum of weights")
    objective: dict[str, float] | None = Field(None, description="objective weights for its batches (parameters "
                                               "from objective.<name>); null = objective.weights")
    prompts: dict[str, str] | None = Field(None, description="its query/document prompts, replacing model.prompts "
                                           "for its texts (an instruction per task); null = model.prompts")

    @field_validator("objective")
    @classmethod
    def _known_objectives(cls, weights: dict[str, float] | None) -> dict[str, float] | None:
        return None if weights is None else _ObjectiveBase._known(weights)

    @property
    def label(self) -> str:
        return self.name or self.train.rstrip("/").rsplit("/", 1)[-1].split(":")[-1]

    def as_data(self, data: "DataConfig") -> "DataConfig":
        """The job's data section reading this source alone."""
        return data.model_copy(update={"train": self.train, "format": self.format, "split": self.split,
                                       "max_rows": self.max_rows, "shuffle_seed": self.shuffle_seed,
                                       "triplets": self.triplets, "group_size": self.group_size, "sources": []})


class DataConfig(Section):
    train: str | None = Field(None, description="training corpus: a file, a folder, or hf:<dataset>[:<config>] "
                              "(Hugging Face datasets, split from data.split)")
    format: DataFormat = (
        Field("auto", description="reader; auto picks by file name; triplets_jsonl: {text1, text2, negative} rows "
              "that supervised InfoNCE trains on; groups_jsonl / groups_parquet: query groups {query, positives: [...], "
              "negatives: [...]} (ray_jobs/mine_negatives.py writes them), a stage1 job")
    )
    split: str | None = Field(None, description="split name for folder layouts (SentEval: dev, test, train) and hf: "
                              "datasets (default train)")
    max_rows: int | None = Field(None, ge=1, description="use only the first N rows (after shuffle_seed, if set)")
    shuffle_seed: int | None = Field(None, description="shuffle rows with this seed before max_rows (fair subsamples)")
    on_bad_record: Literal["fail", "quarantine"] = Field("fail", description="stop on bad rows, or set them aside")
    cache: bool = Field(True, description="keep the validated corpus as Parquet under <trainer.storage_path>/"
                        "corpus_cache and reuse it while the files are unchanged (path, size, modification time or ETag): a "
                        "sweep trial or a resubmission skips parsing and validation")
    cache_max_gb: float | None = Field(None, gt=0, description="keep the corpus cache under this many GB: after each "
                                       "run the least recently used entries go first (null: no limit; attempts "
                                       "a killed run left are removed after a day either way)")
    node_local: bool = Field(False, description="workers read the corpus from memory-mapped Arrow files on their "
                             "node's disk (written once under <trainer.storage_path>/corpus_files, copied once per "
                             "node to RAOE_NODE_CACHE) instead of Ray's object store: for a corpus larger than a "
                             "node's object store; the same rows at every step either way")
    prefetch: bool | None = Field(None, description="take and tokenise the next micro-batch in a background thread "
                                  "while the current one trains; null: on with GPUs, off on CPU, where the thread "
                                  "takes cores from the step (benchmarks/results/input_prefetch.md); data_wait_s "
                                  "shows what a step waited")
    triplets: bool = Field(False, description="NLI pairs -> (premise, entailment, contradiction) triplets: supervised "
                           "SimCSE's hard negatives (infonce/hince see them as emb_neg)")
    group_size: int | None = Field(None, ge=1, description="query groups: the texts each query meets per step, 1 "
                                   "positive and group_size - 1 of its negatives, drawn by (seed, step, row); null = 8 "
                                   "(FlagEmbedding's train_group_size); only with data.format groups_jsonl / "
                                   "groups_parquet")
    sources: list[SourceConfig] = Field(default_factory=list, description="several corpora in place of data.train, "
                                        "each with its own format, weight, objective weights and prompts: each "
                                        "step draws one source by weight (seeded by the step) and its whole global "
                                        "batch from it")

    @model_validator(mode="after")
    def _groups_only(self) -> "DataConfig":
        if self.group_size is not None and not self.groups:
            raise ValueError(f"data.group_size is for query groups (data.format groups_jsonl or groups_parquet), "
                             f"not data.format {self.format}")
        mixed = [s for s in self.sources if isinstance(s, SourceConfig)]  # RSE's data.sources are relation corpora
        if mixed and self.train:
            raise ValueError("data.train and data.sources: name every corpus in data.sources (or only data.train)")
        names = [s.label for s in mixed]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources: names {names} repeat; give each source a distinct name")
        for s in mixed:
            if s.group_size is not None and s.format not in GROUP_FORMATS:
                raise ValueError(f"data.sources[{s.label}].group_size is for query groups, not format {s.format}")
        return self

    @property
    def groups(self) -> bool:
        return self.format in GROUP_FORMATS

    @property
    def texts_per_group(self) -> int:
        return self.group_size or DEFAULT_GROUP_SIZE


def _params_model(name: str) -> type[BaseModel]:
    defaults = DEFAULTS[name]
    fields = {k: (type(v), Field(v)) for k, v in defaults.items()}
    return create_model(f"{name}_params", __base__=Section, **fields)


_PARAM_MODELS = {name: _params_model(name) for name in DEFAULTS}


class MatryoshkaConfig(Section):
    """Matryoshka representation learning (Kusupati et al. 2022): the composite objective at each leading slice of
    the embedding, so the first ``d`` dimensions alone embed well."""

    dims: list[int] = Field(min_length=1, description="embedding sizes trained, e.g. [768, 512, 256, 128, 64]: "
                            "the composite at the first d dimensions of every embedding, renormalised, for each d")
    weights: list[float] | None = Field(None, description="the loss weight of each of dims (null: 1 each)")

    @field_validator("dims")
    @classmethod
    def _distinct(cls, dims: list[int]) -> list[int]:
        if min(dims) < 1 or len(set(dims)) != len(dims):
            raise ValueError(f"dims must be distinct sizes >= 1, got {dims}")
        return dims

    @model_validator(mode="after")
    def _one_weight_per_dim(self) -> "MatryoshkaConfig":
        if self.weights is not None and (len(self.weights) != len(self.dims) or min(self.weights) < 0
                                         or not any(self.weights)):
            raise ValueError(f"weights must be one number >= 0 per dim ({len(self.dims)}), not all 0; "
                             f"got {self.weights}")
        return self

    def pairs(self) -> tuple[tuple[int, float], ...]:
        """(dim, weight) largest first, as CompositeObjective takes them."""
        return tuple(sorted(zip(self.dims, self.weights or [1.0] * len(self.dims)), reverse=True))


class _ObjectiveBase(Section):
    weights: dict[str, float] = Field(
        default_factory=lambda: dict(PRESETS["raoe"]),
        description=f"objective name -> weight; names: {', '.join(DEFAULTS)}",
    )
    matryoshka: MatryoshkaConfig | None = Field(None, description="train truncated embeddings too: {dims: [...], "
                                                "weights: [...]} (null: the full embedding only)")

    @field_validator("weights")
    @classmethod
    def _known(cls, weights: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(weights) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"unknown objective(s) {unknown}; allowed: {', '.join(DEFAULTS)}")
        if not any(w != 0 for w in weights.values()):
            raise ValueError("at least one objective needs a non-zero weight")
        return weights


ObjectiveConfig = create_model(
    "ObjectiveConfig",
    __base__=_ObjectiveBase,
    **{name: (model, Field(default_factory=model)) for name, model in _PARAM_MODELS.items()},
)


def objective_params(config: BaseModel) -> dict[str, dict]:
    """The per-objective parameter dicts of an ObjectiveConfig, for CompositeObjective."""
    return {name: getattr(config, name).model_dump() for name in DEFAULTS}


class RetrievalTaskConfig(Section):
    """A retrieval task in the BEIR layout: a folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) or hf:<dataset>."""

    source: str = Field(description="BEIR folder or hf:<dataset> (NanoBEIR / MTEB layout)")
    split: str = Field("test", description="qrels split (qrels/<split>.tsv); NanoBEIR on the hub has only train")
    name: str | None = Field(None, description="name in results and promotion rules; null = the folder's name")
    max_queries: int | None = Field(None, ge=1, description="score only the first N queries with judgements")
    ignore_identical_ids: bool = Field(
        True, description="a document whose id is the query's id is never a hit (BEIR's default; ArguAna and Quora "
                          "hold each query in the corpus)")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value):
        return {"source": value} if isinstance(value, str) else value

    @property
    def task_name(self) -> str:
        from evaluation.retrieval import task_name  # one rule for a task's default name

        return self.name or task_name(self.source)


class SearchConfig(Section):
    """How the search actors search a corpus index (evaluation.search_actors)."""

    method: Literal["exact", "faiss"] = Field("exact", description="exact: every row scored (a running top-k); "
                                              "faiss: FAISS inverted lists per actor (approximate, faster on large "
                                              "corpora), its recall against exact search reported")
    faiss_lists: int | None = Field(None, ge=1, description="inverted lists per actor; null: sqrt(its rows)")
    faiss_probes: int = Field(32, ge=1, description="lists searched per query (more: higher recall, slower)")
    recall_queries: int = Field(256, ge=0, description="queries also searched exactly to measure the approximate "
                                "search's recall@k (0: not measured)")

    def method_settings(self):
        from evaluation.search_actors import SearchMethod

        return SearchMethod(self.method, self.faiss_lists, self.faiss_probes, self.recall_queries)


class EvalConfig(Section):
    data_dir: str = Field("../shared/data/senteval", description="SentEval-layout root (STS/, SICK/)")
    tasks: list[str] = Field(
        default_factory=lambda: ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"],
        description="tasks to score",
    )
    stsb_split: Literal["test", "dev", "train"] = Field("test", description="STS-B split scored as STSBenchmark")
    batch_size: int = Field(64, ge=1, description="sentences per encoding batch")
    max_pairs: int | None = Field(None, ge=1, description="score only the first N pairs of each task (quick runs)")
    retrieval: list[RetrievalTaskConfig] = Field(default_factory=list, description="retrieval tasks scored next to "
                                                 "STS (nDCG@10, MRR@10, Recall@10/100, MAP@100): BEIR folders or "
                                                 "hf:<dataset>, or {source, split, name, max_queries}")
    dims: CutSizes = Field(default_factory=list, description="also score the suite at these leading embedding "
                            "sizes, cut and renormalised (a Matryoshka model: objective.matryoshka), each from the "
                            "same encoding and corpus index")
    search: SearchConfig = Field(default_factory=SearchConfig, description="how retrieval tasks search their corpus "
                                 "index: exact (default) or faiss")

    @field_validator("retrieval")
    @classmethod
    def _distinct_task_names(cls, tasks):
        names = [t.task_name for t in tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"eval.retrieval: task name(s) {twice} appear twice; give each a distinct name")
        return tasks


class TrackingConfig(Section):
    experiment: str = Field("raoe", description="MLflow experiment")
    run_name: str | None = Field(None, description="MLflow run name; resubmitting the same name resumes it")
    registered_model: str | None = Field(None, description="registry name (default raoe-s1 / raoe-s2 by stage)")
    retry_seconds: float = Field(300.0, ge=0, description="how long end-of-run logging and registration retry (with "
                                 "backoff) while the tracking server does not answer; step metrics are buffered")


class TrainEvalConfig(EvalConfig):
    dev_retrieval: RetrievalTaskConfig | None = Field(
        None, description="select checkpoints by this retrieval task's nDCG@10 (x100; a BEIR folder or hf:<dataset>, "
        "or {source, split, name, max_queries}) instead of STS-B dev Spearman; it reads the 'dev' split unless split "
        "names another (never the test judgements by default); its corpus is encoded whole on the evaluating workers "
        "at every evaluation, so keep it a dev-sized set (at most 200,000 documents)")

    @field_validator("dev_retrieval")
    @classmethod
    def _dev_split_by_default(cls, task: RetrievalTaskConfig | None) -> RetrievalTaskConfig | None:
        """Checkpoint selection on test judgements would report a test score chosen by the test: 'dev' unless set."""
        if task is not None and "split" not in task.model_fields_set:
            return task.model_copy(update={"split": "dev"})
        return task

    @field_validator("search")
    @classmethod
    def _exact_during_training(cls, search: SearchConfig) -> SearchConfig:
        if search.method != "exact":
            raise ValueError("eval.search.method: a training job's dev retrieval searches its dev-sized corpus "
                             "exactly on the evaluating workers; set faiss in the evaluate or promote job")
        return search


class TrainJobConfig(Section):
    """Stage 1: NLI pairs with S, the RAOE composite (paper defaults: I=2, tau=20, w=1,1, lr 5e-5, 512, 5 epochs)."""

    stage: Literal["stage1", "stage2"] = Field("stage1", description="stage1 (NLI with S) or stage2 (STS-B train)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    eval: TrainEvalConfig = Field(default_factory=lambda: TrainEvalConfig(tasks=["STSBenchmark"], stsb_split="dev"),
                                  description="STS-B dev (eval.max_pairs subsamples it) or eval.dev_retrieval "
                                  "selects checkpoints")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-train"))
    output_dir: OutputPath = Field("outputs/models", validate_default=True, description="the best model is exported "
                                   "under <output_dir>/<run name>; " + RELATIVE)
    shared_filesystem: SharedFilesystem = False


class Stage2JobConfig(TrainJobConfig):
    """Stage 2: STS-B train with S = score / 5, rank margin only, 10 epochs, from a Stage 1 model."""

    stage: Literal["stage1", "stage2"] = Field("stage2", description="stage1 (NLI with S) or stage2 (STS-B train)")
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(epochs=10.0))
    objective: ObjectiveConfig = Field(default_factory=lambda: ObjectiveConfig(weights=dict(PRESETS["raoe_s2"])))


class UnsupervisedJobConfig(TrainJobConfig):
    """Unsupervised SimCSE on a sentence corpus (each sentence twice through the encoder, dropout makes the positive;
    InfoNCE), or SimCSE+SAN (objective hince: aligned negatives from ray_jobs/generate_san.py, encoded at dropout
    model.negative_dropout = p2). Defaults from SimCSE and the SAN paper: lr 3e-5, batch 64, max length 32, 1 epoch,
    dropout 0.1, tau 0.05 (hince: tau2 0.08, p2 0.2)."""

    stage: Literal["unsupervised"] = Field("unsupervised", description="unsupervised (sentence corpus)")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(max_length=32, dropout=0.1, negative_dropout=0.2))
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(epochs=1.0, lr=3e-5, global_batch_size=64))
    objective: ObjectiveConfig = Field(default_factory=lambda: ObjectiveConfig(weights={"infonce": 1.0}))


class PosttrainSection(Section):
    teacher: str | None = Field(None, description="encoder whose similarity matrix of each list gives the ListMLE "
                                "targets (path, pypi:, models:/...; loaded as sentence-transformers loads it); null = "
                                "the start model, frozen, encoding as training does (model.pooling, prompt, "
                                "padding_side, max_length)")
    teacher_cpus: float = Field(0.5, gt=0, description="CPUs of each teacher-scoring actor before training")
    teacher_gpus: float = Field(0.0, ge=0, description="GPUs of each teacher-scoring actor (> 0: the teacher on it)")
    teacher_actors: int = Field(1, ge=1, description="teacher-scoring actors that score the lists before training, "
                                "in parallel (a large list corpus on a cluster: one per GPU or node)")
    teacher_trust_remote_code: bool | None = Field(None, description="trust_remote_code for the "
                                                   "teacher; null = as model.trust_remote_code")


class PosttrainJobConfig(TrainJobConfig):
    """ListMLE post-training on ranked sentence lists (ranking-sentences Eq. 5-8): per list, the student's cosine
    matrix / tau ranked by the refined (omega) targets of a teacher's similarity matrix. The authors' settings: lr 3e-6,
    one list of 33 sentences per step, checkpoint selection every 25 steps, omega 0.5 (0.7 for SynCSE-r)."""

    stage: Literal["posttrain"] = Field("posttrain", description="posttrain (ranked lists)")
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(
        epochs=1.0, lr=3e-6, global_batch_size=2, eval_every=25, warmup_ratio=0.0))
    objective: ObjectiveConfig = Field(default_factory=lambda: ObjectiveConfig(weights={"listmle": 1.0}))
    posttrain: PosttrainSection = Field(default_factory=PosttrainSection)


class TripleSource(Section):
    """One corpus of relation triples, or a corpus mapped to them."""

    train: str = Field(..., description="a file, folder or hf:<dataset>")
    format: Literal["auto", "jsonl", "parquet", "senteval_nli", "snli_jsonl", "pairs_jsonl", "txt"] = Field(
        "auto", description="reader; auto picks by file name")
    split: str | None = Field(None, description="split of a SentEval folder or hf: dataset")
    mapping: Literal["triples", "nli", "same-sent"] = Field(
        "triples", description="triples: rows {head, tail, relation, negative?}; nli: NLI pairs -> (premise, "
        "entailment hypothesis, contradiction hypothesis as the hard negative); same-sent: each sentence related to "
        "itself (dropout makes the two views)")
    relation: str | None = Field(None, description="relation name for nli / same-sent rows (default 'entailment' / "
                                 "'same-sent'); with triples, every row's relation is renamed to it")
    max_rows: int | None = Field(None, ge=1, description="use only the first N records (after shuffle_seed)")
    shuffle_seed: int | None = Field(None, description="shuffle records with this seed before max_rows")


class RelationalDataConfig(DataConfig):
    format: Literal["auto", "jsonl", "parquet", "senteval_nli", "snli_jsonl", "pairs_jsonl", "txt"] = Field(
        "auto", description="reader of data.train; auto picks by file name")
    mapping: Literal["triples", "nli", "same-sent"] = Field("triples", description="what data.train holds "
                                                          "(see data.sources)")
    relation: str | None = Field(None, description="relation name for data.train's rows (see data.sources)")
    sources: list[TripleSource] = Field(default_factory=list, description="more corpora next to data.train, each "
                                        "with its own train/format/split/mapping/relation/max_rows")
    relations: list[str] | None = Field(None, description="the relation set, in table order; null = the names the "
                                        "corpus holds, sorted; a name outside a fixed set is an error")
    caps: dict[str, int] = Field(default_factory=dict, description="relation -> at most this many triples (a seeded "
                                 "sample; the paper caps non-NLI relations at 150K)")
    weights: dict[str, float] = Field(default_factory=dict, description="relation -> sampling weight: each triple "
                                      "appears w times per epoch on average (whole copies plus a seeded share)")
    heldout: int = Field(0, ge=0, description="triples per relation held out of training for relation prediction "
                         "(MRR, Hits@k); 0 = none")

    @field_validator("caps")
    @classmethod
    def _caps_positive(cls, caps: dict[str, int]) -> dict[str, int]:
        bad = {k: v for k, v in caps.items() if v < 1}
        if bad:
            raise ValueError(f"caps must be at least 1: {bad}")
        return caps

    @field_validator("weights")
    @classmethod
    def _weights_positive(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in weights.items() if not v > 0}
        if bad:
            raise ValueError(f"sampling weights must be > 0: {bad}")
        return weights


class RelationalSection(Section):
    relation_lr: float = Field(1e-2, gt=0, description="learning rate of the relation vectors (randomly initialised, "
                               "so far above the encoder's; the paper's 1e-2), no weight decay")
    init_std: float = Field(0.02, gt=0, description="relation vectors start as N(0, init_std^2) (BERT's embedding "
                            "init, as the paper's nn.Embedding gets)")


class RelationalEvalConfig(EvalConfig):
    relation_weights: dict[str, float] | None = Field(
        None, description="relation -> weight of its score cos(h_a + r, h_b) for STS (normalised to sum 1, max over "
        "both directions); null = equal weights over every relation")


class RelationalTrainEvalConfig(RelationalEvalConfig, TrainEvalConfig):
    """RSE training's evaluation: relation weights for STS-B dev, or a retrieval dev task."""


class RelationalJobConfig(TrainJobConfig):
    """RSE (relational sentence embeddings): an encoder and a learned vector per relation, trained so that
    cos(h_head + r, h_tail) beats in-batch tails and in-relation hard negatives (Eq. 1-2). The authors' settings:
    CLS pooling, tau 0.05, lr 5e-5, relation lr 1e-2, batch 512, 3 epochs, max length 32, no warm-up or weight decay,
    STS-B dev every 125 steps with relation weights entailment 1.0 + duplicate-question 0.5."""

    stage: Literal["relational"] = Field("relational", description="relational (relation triples)")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(pooling="cls", max_length=32))
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(
        epochs=3.0, lr=5e-5, global_batch_size=512, warmup_ratio=0.0, weight_decay=0.0, eval_every=125))
    data: RelationalDataConfig = Field(default_factory=RelationalDataConfig)
    objective: ObjectiveConfig = Field(default_factory=lambda: ObjectiveConfig(weights={"relational": 1.0}))
    eval: RelationalTrainEvalConfig = Field(default_factory=lambda: RelationalTrainEvalConfig(tasks=["STSBenchmark"],
                                                                                    stsb_split="dev"))
    relational: RelationalSection = Field(default_factory=RelationalSection)

    @field_validator("trainer")
    @classmethod
    def _no_zero3(cls, trainer: TrainerConfig) -> TrainerConfig:
        if trainer.strategy == "deepspeed" and trainer.zero_stage == 3:
            raise ValueError("trainer.zero_stage 3 is not supported by the relational job: the relation table is "
                             "used outside the encoder's forward, where ZeRO-3 keeps it partitioned; use stage 0-2")
        return trainer
