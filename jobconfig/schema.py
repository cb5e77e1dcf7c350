"""Typed config sections shared by every job. Unknown keys are errors (extra='forbid')."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from objectives.registry import PRESETS, SPECS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    dropout: float | None = Field(None, ge=0.0, le=1.0, description="attention/hidden dropout; null keeps the backbone's")
    init_from: str | None = Field(None, description="start from a trained model: path or models:/name/version|@alias")
    quantization: Literal["none", "nf4", "int8"] = Field("none", description="load the base frozen in 4-bit NF4 or 8-bit")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters only (null: full fine-tuning)")
    padding_side: Literal["left", "right"] | None = Field(None, description="tokenizer padding side; null keeps its own")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward (less memory)")
    negative_dropout: float | None = Field(None, ge=0.0, le=1.0, description="dropout of the aligned negatives' "
                                           "forward pass (SAN's p2, unsupervised job); null = model.dropout")


class TrainerConfig(Section):
    num_workers: int = Field(1, ge=1, description="Ray Train workers")
    strategy: Literal["ddp", "deepspeed"] = Field("ddp", description="DDP (torch backend) or DeepSpeed ZeRO")
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage")
    global_batch_size: int = Field(512, ge=1, description="rows (pairs, sentences, lists) per optimizer step over all "
                                   "workers")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    epochs: float = Field(5.0, gt=0, description="passes over the data when max_steps is null")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; overrides epochs")
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.01, ge=0)
    warmup_ratio: float = Field(0.1, ge=0, le=1, description="linear warm-up share of the steps")
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm; null disables")
    bf16: bool = Field(False, description="bf16 autocast of the encoder forward; weights, gradients, checkpoints and "
                       "exports stay fp32 under DDP and DeepSpeed alike")
    length_buckets: int = Field(2, ge=1, description="forward passes per micro-batch over its texts grouped by length "
                                "(each padded to its own longest text); 1 = one pass")
    seed: int = Field(42, description="seeds Python, NumPy, torch and the data order")
    cpus_per_worker: float = Field(0.5, gt=0, description="fractional on CPU so Ray Data readers never starve")
    use_gpu: bool = Field(False)
    eval_every: int = Field(50, ge=1, description="steps between STS-B dev evaluations and checkpoints")
    max_failures: int = Field(0, ge=-1, description="worker-group restarts from the last checkpoint (-1 = forever)")
    threads_per_worker: int | None = Field(None, ge=1, description="torch threads per worker; null = torch's default")
    keep_checkpoints: int = Field(2, ge=1, description="best checkpoints kept by dev Spearman (the latest is kept too)")
    storage_path: str = Field("raoe_runs", description="Ray Train storage for checkpoints (local path, s3://, gs://)")


class DataConfig(Section):
    train: str | None = Field(None, description="training corpus: a file, a folder, or hf:<dataset>[:<config>] "
                              "(Hugging Face datasets, split from data.split)")
    format: Literal["auto", "pairs_jsonl", "snli_jsonl", "senteval_nli", "csv", "parquet", "stsb_csv", "senteval_sts",
                    "txt", "jsonl"] = (
        Field("auto", description="reader; auto picks by file name")
    )
    split: str | None = Field(None, description="split name for folder layouts (SentEval: dev, test, train) and hf: "
                              "datasets (default train)")
    max_rows: int | None = Field(None, ge=1, description="use only the first N rows (after shuffle_seed, if set)")
    shuffle_seed: int | None = Field(None, description="shuffle rows with this seed before max_rows (fair subsamples)")
    on_bad_record: Literal["fail", "quarantine"] = Field("fail", description="stop on bad rows, or set them aside")
    triplets: bool = Field(False, description="NLI pairs -> (premise, entailment, contradiction) triplets: supervised "
                           "SimCSE's hard negatives (infonce/hince see them as emb_neg)")


def _params_model(name: str) -> type[BaseModel]:
    defaults = SPECS[name].defaults
    fields = {k: (type(v), Field(v)) for k, v in defaults.items()}
    return create_model(f"{name}_params", __base__=Section, **fields)


_PARAM_MODELS = {name: _params_model(name) for name in SPECS}


class _ObjectiveBase(Section):
    weights: dict[str, float] = Field(
        default_factory=lambda: dict(PRESETS["raoe"]),
        description=f"objective name -> weight; names: {', '.join(SPECS)}",
    )

    @field_validator("weights")
    @classmethod
    def _known(cls, weights: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(weights) - set(SPECS))
        if unknown:
            raise ValueError(f"unknown objective(s) {unknown}; allowed: {', '.join(SPECS)}")
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
    return {name: getattr(config, name).model_dump() for name in SPECS}


class EvalConfig(Section):
    data_dir: str = Field("../shared/data/senteval", description="SentEval-layout root (STS/, SICK/)")
    tasks: list[str] = Field(
        default_factory=lambda: ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"],
        description="tasks to score",
    )
    stsb_split: Literal["test", "dev", "train"] = Field("test", description="STS-B split scored as STSBenchmark")
    batch_size: int = Field(64, ge=1, description="sentences per encoding batch")
    max_pairs: int | None = Field(None, ge=1, description="score only the first N pairs of each task (quick runs)")


class TrackingConfig(Section):
    experiment: str = Field("raoe", description="MLflow experiment")
    run_name: str | None = Field(None, description="MLflow run name; resubmitting the same name resumes it")
    registered_model: str | None = Field(None, description="registry name (default raoe-s1 / raoe-s2 by stage)")


class TrainJobConfig(Section):
    """Stage 1: NLI pairs with S, the RAOE composite (paper defaults: I=2, tau=20, w=1,1, lr 5e-5, 512, 5 epochs)."""

    stage: Literal["stage1", "stage2"] = Field("stage1", description="stage1 (NLI with S) or stage2 (STS-B train)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig(tasks=["STSBenchmark"], stsb_split="dev"),
                             description="STS-B dev selects checkpoints; eval.max_pairs subsamples it")
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig(experiment="raoe-train"))
    output_dir: str = Field("outputs/models", description="the best model is exported under <output_dir>/<run name>")


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
                                "targets (path, pypi:, models:/...); null = the start model, frozen")
    teacher_cpus: float = Field(0.5, gt=0, description="CPUs of the teacher-scoring actor before training")


class PosttrainJobConfig(TrainJobConfig):
    """ListMLE post-training on ranked sentence lists (ranking-sentences Eq. 5-8): per list, the student's cosine
    matrix / tau ranked by the refined (omega) targets of a teacher's similarity matrix. The authors' settings: lr 3e-6,
    one list of 33 sentences per step, checkpoint selection every 25 steps, omega 0.5 (0.7 for SynCSE-r)."""

    stage: Literal["posttrain"] = Field("posttrain", description="posttrain (ranked lists)")
    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(
        epochs=1.0, lr=3e-6, global_batch_size=2, eval_every=25, warmup_ratio=0.0))
    objective: ObjectiveConfig = Field(default_factory=lambda: ObjectiveConfig(weights={"listmle": 1.0}))
    posttrain: PosttrainSection = Field(default_factory=PosttrainSection)
