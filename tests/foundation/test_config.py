"""The config system: YAML + --set overrides, coercion, unknown keys and bad values named in errors, --help."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from jobconfig import ConfigError, load_config, parse_job_args
from jobconfig.schema import EvalConfig, ModelConfig, ObjectiveConfig, Section, TrainerConfig


class Job(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output_dir: str = "raoe_runs"


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides_in_order_with_coercion(tmp_path):
    path = write(tmp_path, "trainer:\n  num_workers: 2\n  lr: 1.0e-4\nmodel:\n  pooling: cls\n")
    cfg = load_config(Job, path, ["trainer.num_workers=4", "trainer.lr=2e-5", "trainer.bf16=true",
                                  "objective.rank_margin.margin=16", "objective.weights.gated_angle=0.5",
                                  "eval.tasks=[STS12, STSBenchmark]", "trainer.max_steps=null", "trainer.max_steps=7"])
    assert cfg.trainer.num_workers == 4 and isinstance(cfg.trainer.num_workers, int)
    assert cfg.trainer.lr == pytest.approx(2e-5) and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.bf16 is True and cfg.trainer.max_steps == 7
    assert cfg.model.pooling == "cls"
    assert cfg.objective.rank_margin.margin == 16.0 and cfg.objective.rank_margin.tau == 20.0
    assert cfg.objective.weights == {"rank_margin": 1.0, "gated_angle": 0.5}
    assert cfg.eval.tasks == ["STS12", "STSBenchmark"]


def test_defaults_are_the_papers():
    cfg = load_config(Job)
    assert (cfg.trainer.seed, cfg.trainer.global_batch_size, cfg.trainer.lr) == (42, 512, 5e-5)
    assert cfg.objective.weights == {"rank_margin": 1.0, "gated_angle": 1.0}
    assert (cfg.objective.rank_margin.margin, cfg.objective.rank_margin.tau) == (2.0, 20.0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.num_wrkers=2", "unknown key 'trainer.num_wrkers'; did you mean 'trainer.num_workers'"),
        ("trainer.strategy=horovod", "trainer.strategy: Input should be 'ddp' or 'deepspeed' (got 'horovod')"),
        ("trainer.num_workers=two", "trainer.num_workers.int: Input should be a valid integer"),
        ("trainer.num_workers=-1", "trainer.num_workers: Value error, must be a count >= 1, 0 (train in the job"),
        ("trainer.num_workers=0\ntrainer.max_failures=2", "trainer.max_failures=2 restarts a worker group"),
        ("trainer.num_workers=[2, 1]", "with 1 <= min <= max (elastic)"),
        ("trainer.num_workers=[1, 2]\ntrainer.strategy=deepspeed", "(elastic) needs trainer.strategy ddp"),
        ("model.pooling=max", "model.pooling: Input should be 'mean', 'cls' or 'last_token'"),
        ("objective.weights.rank_marginn=1", "unknown objective(s) ['rank_marginn']"),
        ("objective.rank_margin.margn=3", "unknown key 'objective.rank_margin.margn'; did you mean"),
        ("trainer.lr.x=1", "key 'trainer.lr' is a value, not a section"),
        ("trainer.lr", "--set expects key=value"),
        ("trainer.seed=-1", "trainer.seed: Input should be greater than or equal to 0"),
    ],
)
def test_bad_overrides_name_the_key_and_the_allowed_values(override, message):
    with pytest.raises(ConfigError) as exc:
        load_config(Job, None, override.split("\n"))
    assert message in str(exc.value)


def test_unknown_key_in_yaml_lists_the_allowed_keys(tmp_path):
    path = write(tmp_path, "trainer:\n  epochz: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(Job, path)
    assert "unknown key 'trainer.epochz'; did you mean 'trainer.epochs'?" in str(exc.value)
    assert "global_batch_size" in str(exc.value)


def test_broken_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "trainer:\n  num_workers: 2\n lr: [\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(Job, path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Job, tmp_path / "missing.yaml")


def test_parse_job_args_exits_2_with_the_message(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_job_args(Job, "test job", ["--set", "trainer.strategy=x"])
    assert exc.value.code == 2
    assert "trainer.strategy" in capsys.readouterr().err


def test_job_help_lists_the_keys():
    out = subprocess.run([sys.executable, "ray_jobs/evaluate.py", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--set KEY=VALUE" in out and "eval.data_dir" in out and "model.source" in out and "eval.max_pairs" in out


def test_yaml_weights_replace_the_default_mix(tmp_path):
    path = write(tmp_path, "objective:\n  weights: {cosent: 1.0}\n  cosent: {tau: 10}\n")
    cfg = load_config(Job, path)
    assert cfg.objective.weights == {"cosent": 1.0} and cfg.objective.cosent.tau == 10.0



ROOT = Path(__file__).resolve().parents[2]


def _job_model(path):
    """The config model of the job a shipped YAML is for (by folder, or by file name under tiny/ and the recipe
    folder retrieval/)."""
    import importlib

    from jobconfig.schema import Stage2JobConfig, TrainJobConfig

    job = path.parent.name if path.parent.name not in ("tiny", "retrieval") else path.stem
    if path.parent.name == "retrieval":
        job = {"mine": "mine_negatives"}.get(job.split("-")[0], job.split("-")[0])
    if path.parent.name == "tiny" and not job.startswith("sweep"):  # stage1-sources: a variant of a job's config
        job = job.split("-")[0]
    job = "sweep" if job.startswith("sweep") else {"qlora": "stage1", "promote": "promote"}.get(job, job)
    if job == "sweep":
        from tuning.sweep import SweepSpec

        return SweepSpec
    if job in ("stage1", "stage2"):
        return TrainJobConfig if job == "stage1" else Stage2JobConfig
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    try:
        module = importlib.import_module(job)
    finally:
        sys.path.remove(str(ROOT / "ray_jobs"))
    return next(v for k, v in vars(module).items() if k.endswith("JobConfig"))


def test_every_shipped_config_validates():
    """Shipped YAMLs are validated like a job would, so a renamed key cannot break one unnoticed."""
    checked = 0
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        config = load_config(_job_model(path), path)
        if hasattr(config, "grid"):  # a sweep: every grid point must make a valid training config
            from tuning.sweep import validate_spec

            assert len(validate_spec(config, "check", "/tmp/raoe-check")) == math.prod(map(len, config.grid.values()))
        checked += 1
    assert checked >= 10


def test_a_typo_inside_a_list_of_sections_names_the_item_and_the_allowed_keys():
    from jobconfig.schema import RelationalJobConfig

    with pytest.raises(ConfigError, match=r"'data.sources.1.mappin'; did you mean 'data.sources.1.mapping'"):
        load_config(RelationalJobConfig, None, ["data.sources=[{train: a}, {train: b, mappin: nli}]"])
    with pytest.raises(ConfigError, match="zero_stage 3 is not supported by the relational job"):
        load_config(RelationalJobConfig, None, ["trainer.strategy=deepspeed", "trainer.zero_stage=3"])


def test_validating_a_config_and_reading_the_corpus_do_not_load_torch():
    """The schema and the driver's checks read objectives.catalog, the kinds table names its batch builders to import
    on first call: a job's --help, config validation, the driver until its corpus is read (a corpus whose every row
    is bad fails at ~330 MB, not ~510) and the Ray Data tasks that carry a config section (RSE's relation
    preparation) load no torch (~250 MB a process); objectives.composite computes exactly what the catalog names."""
    code = ("import importlib, sys; import jobconfig.schema, data_pipelines.relations, training.run, tuning.sweep; "
            "from training.kinds import TRAINING_KINDS; "
            "[importlib.import_module(f.module) for k in TRAINING_KINDS.values() if k.name != 'lists' "
            "for f in (k.load, k.corpus_to_rows) if f is not None]; "  # each kind's driver side (lists: its teacher)
            "print('torch' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True,
                            capture_output=True, text=True).stdout.strip()
    assert loaded == "False"
    from objectives.catalog import CATALOG
    from objectives.composite import SPECS

    assert set(SPECS) == set(CATALOG)
