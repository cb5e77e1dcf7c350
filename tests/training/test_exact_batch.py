"""The exact global batch with dropout on: chunks are seeded by their place in the step, so 1 worker and 2 workers
give the same step-1 loss, gradient norm and full gradient for every kind of data; cached embeddings (GradCache) give
the loss, gradient norm and gradient of the direct step under DDP, ZeRO 0-3, bf16 autocast and checkpointed QLoRA.

One optimizer step of training.step's Stepper per scenario, in gloo process groups of 1 and 2 (no Ray: the loop's
step, strategies and gathers are the ones Ray Train runs), with dropout 0.1, SAN's negative dropout 0.2, two length
buckets, and the objective each kind trains with."""

import os
import socket
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch.multiprocessing as mp

from tests.training.conftest import SAME_START_REL

BATCH = 8
WORDS = ("a man sits on a bench", "a dog runs in the park", "two kids play football on the beach", "rain falls",
         "the cat sleeps", "a woman reads a long book about trains", "people walk down the street", "a boy eats")
TEXTS = np.array(WORDS, dtype=object)
OTHER = np.array([w.replace("a ", "the ") + " today" for w in WORDS], dtype=object)


def _cells(lists: list[list[str]]) -> np.ndarray:
    out = np.empty(len(lists), dtype=object)
    out[:] = lists
    return out


def _lists() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    lists, sims = np.empty(BATCH, dtype=object), np.empty(BATCH, dtype=object)
    for i in range(BATCH):
        n = 2 + i % 3  # lists of 2 to 4 sentences
        lists[i] = [WORDS[(i + j) % BATCH] for j in range(n)]
        sim = rng.uniform(-1, 1, (n, n))
        sims[i] = ((sim + sim.T) / 2).astype(np.float32).ravel()
    return {"sentences": lists, "teacher_sim": sims}


ROWS = {
    "pairs": {"text1": TEXTS, "text2": OTHER, "label": np.arange(BATCH) % 3, "similarity": np.linspace(0.05, 0.95, BATCH)},
    "sts": {"text1": TEXTS, "text2": OTHER, "similarity": np.linspace(0.95, 0.05, BATCH)},
    "triplets": {"text1": TEXTS, "text2": OTHER, "text_neg": np.roll(TEXTS, 3), "label": np.zeros(BATCH, int)},
    "sentences": {"text": TEXTS},
    "sentences_san": {"text": TEXTS, "negative": np.array([o if i % 3 else None for i, o in enumerate(OTHER)],
                                                          dtype=object)},
    "lists": _lists(),
    "triples": {"head": TEXTS, "tail": OTHER, "negative": np.roll(OTHER, 2), "relation_id": np.arange(BATCH) % 2},
    # query groups: 1 or 2 positives, 2 to 4 negatives, of which each step draws GROUP_SIZE - 1
    "groups": {"query": TEXTS, "positives": _cells([[OTHER[i]] + ([WORDS[(i + 4) % BATCH]] if i % 2 else [])
                                                    for i in range(BATCH)]),
               "negatives": _cells([[f"{WORDS[(i + j) % BATCH]} again" for j in range(1, 3 + i % 3)]
                                    for i in range(BATCH)]),
               # a teacher's scores of each positive and negative, for distillation
               "positive_scores": _cells([[0.9 - 0.05 * i] + ([0.7] if i % 2 else []) for i in range(BATCH)]),
               "negative_scores": _cells([[0.5 - 0.1 * j + 0.01 * i for j in range(1, 3 + i % 3)]
                                          for i in range(BATCH)])},
}
GROUP_SIZE = 4
OBJECTIVES = {"pairs": {"rank_margin": 1.0, "gated_angle": 1.0, "angle_ibn": 1.0},
              "sts": {"cosent": 1.0, "angle_ibn": 1.0, "angle": 1.0}, "triplets": {"infonce": 1.0},
              "sentences": {"infonce": 1.0}, "sentences_san": {"hince": 1.0}, "lists": {"listmle": 1.0},
              "triples": {"relational": 1.0}, "groups": {"infonce": 1.0}}


@dataclass(frozen=True)
class Scenario:
    kind: str
    chunk: int = 4
    cached: bool = False
    strategy: str = "ddp"
    zero: int = 2
    accum: int = 1
    model: str = "bert"  # or "qlora": a tiny 4-bit causal LM with LoRA and gradient checkpointing
    bf16: bool = False  # trainer.bf16: the encoder under bf16 autocast
    seed: int = 7
    objective: str = ""  # one objective in place of the kind's OBJECTIVES
    sided: bool = False  # query and document prompts and a shorter query length (model.prompts): two encode calls
    matryoshka: bool = False  # objective.matryoshka at 32 (the tiny model's width), 16 and 8 dimensions
    name: str = field(init=False, default="")

    def __post_init__(self):
        object.__setattr__(self, "name", f"{self.kind} {self.strategy}{self.zero if self.strategy != 'ddp' else ''} "
                                         f"chunk {self.chunk} accum {self.accum} {self.model}"
                                         f"{' cached' if self.cached else ''}{' bf16' if self.bf16 else ''} "
                                         f"seed {self.seed}{' ' + self.objective if self.objective else ''}"
                                         f"{' sided' if self.sided else ''}{' matryoshka' if self.matryoshka else ''}")


def _model(scenario: Scenario):
    from encoders.backbone import build_encoder
    from encoders.sources import resolve_model_source

    if scenario.model == "qlora":
        import torch

        torch.manual_seed(0)  # the LoRA adapters' initialisation
        return build_encoder(resolve_model_source("tiny:qwen2"), pooling="last_token", quantization="nf4",
                             lora={"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": "all-linear"},
                             gradient_checkpointing=True, padding_side="left", max_length=32)
    sides = {"prompts": {"query": "query: ", "document": "passage: "}, "query_max_length": 8} if scenario.sided else {}
    return build_encoder(resolve_model_source("tiny:bert"), dropout=0.1, max_length=32, **sides)


def _gradient_taken(strategy, model) -> dict:
    """Where the full gradient of step 1 lands (every trainable parameter by name, flat, float64), taken before the
    optimizer consumes it: from the parameters under DDP, through DeepSpeed's ``safe_get_full_grad`` at the
    accumulation boundary (ZeRO partitions it; every rank asks for every parameter in the same order)."""
    import torch

    taken, params = {}, [p for _, p in sorted(model.named_parameters()) if p.requires_grad]

    def flat(grads) -> np.ndarray:
        return torch.cat([(torch.zeros_like(p) if g is None else g).detach().double().flatten()
                          for p, g in zip(params, grads)]).numpy()

    if hasattr(strategy, "engine"):
        from deepspeed.utils import safe_get_full_grad

        engine_step = strategy.engine.step

        def step(*args, **kwargs):
            if strategy.engine.is_gradient_accumulation_boundary():
                taken["grad"] = flat([safe_get_full_grad(p) for p in params])
            return engine_step(*args, **kwargs)

        strategy.engine.step = step
    else:
        optimizer_step = strategy.step

        def step():
            taken["grad"] = flat([p.grad for p in params])
            return optimizer_step()

        strategy.step = step
    return taken


def one_step(scenario: Scenario, rank: int, world: int) -> tuple[float, float, np.ndarray]:
    """Step 1's loss, global gradient norm (before clipping) and full gradient on this worker."""
    import torch

    from jobconfig.schema import TrainerConfig
    from objectives.composite import CompositeObjective, fields_read
    from training.kinds import FIELD_COLUMNS, TRAINING_KINDS, BatchContext, ModelAdditions
    from training.kinds.triples import add_relation_table
    from training.plan import plan_steps
    from training.rows import InMemoryRows
    from training.step import Stepper
    from training.strategy import STRATEGIES

    kind, rows = TRAINING_KINDS[scenario.kind], ROWS[scenario.kind]
    model = _model(scenario)
    additions = ModelAdditions()
    if kind.setup_model is not None:
        additions = add_relation_table(model, {"relations": ["entailment", "paraphrase"], "relation_lr": 1e-2,
                                               "init_std": 0.1}, None, seed=0)
    model.train()
    trainer = TrainerConfig(num_workers=world, strategy="deepspeed" if scenario.strategy == "zero" else "ddp",
                            zero_stage=scenario.zero, global_batch_size=BATCH, grad_accum=scenario.accum,
                            chunk_size=scenario.chunk, cache_embeddings=scenario.cached, lr=1e-3, warmup_ratio=0.0,
                            bf16=scenario.bf16)
    plan = plan_steps(BATCH, world=world, global_batch=BATCH, grad_accum=scenario.accum, chunk_size=scenario.chunk,
                      max_steps=1)
    strategy = STRATEGIES[trainer.strategy](model, trainer, plan, world, additions)
    weights = {scenario.objective: 1.0} if scenario.objective else OBJECTIVES[scenario.kind]
    fields = tuple(sorted(fields_read(weights, kind.provides) & set(FIELD_COLUMNS)))
    batches = BatchContext(module=strategy.module, model=model, device=torch.device("cpu"), autocast=strategy.autocast,
                           length_buckets=2, fields=fields, negative_dropout=0.2, sides=kind.sides,
                           group_size=GROUP_SIZE)
    matryoshka = ((32, 1.0), (16, 0.5), (8, 0.25)) if scenario.matryoshka else ()
    stepper = Stepper(plan, scenario.seed, kind, batches, strategy, CompositeObjective(weights, matryoshka=matryoshka),
                      rank, cache_embeddings=scenario.cached)
    taken = _gradient_taken(strategy, model)
    feed = stepper.feed(InMemoryRows(rows), prefetch=False)
    loss, _ = stepper(feed, 0)
    norm = strategy.step()
    feed.close()
    return loss, float(norm), taken["grad"]


def _worker(rank: int, world: int, port: int, scenarios: list[Scenario], results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                       "HF_HUB_OFFLINE": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for scenario in scenarios:
        try:
            out[scenario.name] = one_step(scenario, rank, world)
        except Exception as exc:  # reported by name, not as a hung group
            out[scenario.name] = f"{type(exc).__name__}: {exc}"
            break
    results.put((rank, out))
    results.close()
    results.join_thread()
    dist.destroy_process_group()


def run_group(world: int, scenarios: list[Scenario]) -> dict[str, tuple[float, float]]:
    """Every scenario on a gloo group of ``world`` processes; rank 0's (loss, gradient norm) by scenario name, after
    checking every rank reports the same."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [context.Process(target=_worker, args=(r, world, port, scenarios, results)) for r in range(world)]
    for w in workers:
        w.start()
    got = dict(results.get(timeout=600) for _ in workers)
    for w in workers:
        w.join(timeout=60)
    for name, value in got[0].items():
        assert not isinstance(value, str), f"{name}: {value}"
        for r in got:  # every rank the same
            assert got[r][name][:2] == pytest.approx(value[:2], rel=1e-6), name
            assert np.linalg.norm(got[r][name][2] - value[2]) <= 1e-6 * np.linalg.norm(value[2]), name
    return got[0]


KINDS = sorted(ROWS)
ONE = [Scenario(k) for k in KINDS] + [
    Scenario("pairs", chunk=8),  # other chunks, other masks: what the equality below would miss if chunks were ignored
    Scenario("pairs", seed=8),
    Scenario("pairs", chunk=2, accum=2, cached=True),
    # the triplets' negatives gathered but not read by AnglE's in-batch negatives: a zero gradient, not a crash
    Scenario("triplets", objective="angle_ibn"), Scenario("triplets", objective="angle_ibn", cached=True),
    Scenario("triplets", sided=True), Scenario("groups", matryoshka=True),
    Scenario("groups", objective="distill_kl"), Scenario("groups", objective="margin_mse"),
]
TWO = [Scenario(k) for k in KINDS] + [Scenario(k, cached=True) for k in KINDS] + [
    Scenario("triplets", objective="angle_ibn"), Scenario("triplets", objective="angle_ibn", cached=True),
    Scenario("pairs", chunk=2, accum=2, cached=True),
    Scenario("pairs", strategy="zero", zero=2), Scenario("pairs", strategy="zero", zero=2, cached=True),
    Scenario("triples", strategy="zero", zero=2), Scenario("triples", strategy="zero", zero=2, cached=True),
    Scenario("sentences_san", strategy="zero", zero=3),
    Scenario("sentences_san", strategy="zero", zero=3, cached=True),
    Scenario("pairs", chunk=2, model="qlora"), Scenario("pairs", chunk=2, model="qlora", cached=True),
    Scenario("pairs", strategy="zero", zero=0, cached=True), Scenario("pairs", strategy="zero", zero=1, cached=True),
    Scenario("sts", bf16=True), Scenario("sts", bf16=True, cached=True),
    Scenario("sts", strategy="zero", zero=2, bf16=True, cached=True),
    Scenario("triplets", sided=True), Scenario("triplets", sided=True, cached=True),
    Scenario("groups", strategy="zero", zero=2, cached=True),
    Scenario("groups", matryoshka=True), Scenario("groups", matryoshka=True, cached=True),
    Scenario("groups", objective="distill_kl"), Scenario("groups", objective="distill_kl", cached=True),
    Scenario("groups", objective="margin_mse"), Scenario("groups", objective="margin_mse", cached=True),
    Scenario("triples", matryoshka=True), Scenario("triples", strategy="zero", zero=2, matryoshka=True, cached=True),
]


@pytest.fixture(scope="module")
def steps():
    """Every scenario on one process, then on a group of two. About 35 s here: three spawned processes import the
    training stack and run every scenario."""
    return {1: run_group(1, ONE), 2: run_group(2, TWO)}


def _same(a: tuple, b: tuple, what: str) -> None:
    """The same loss, gradient norm and gradient: the whole vector, so a wrong gradient with the right norm fails."""
    assert a[0] == pytest.approx(b[0], rel=SAME_START_REL), f"loss, {what}"
    assert a[1] == pytest.approx(b[1], rel=SAME_START_REL), f"gradient norm, {what}"
    assert a[2].shape == b[2].shape, f"gradient size, {what}"
    error, scale = np.linalg.norm(a[2] - b[2]), np.linalg.norm(b[2])
    assert error <= SAME_START_REL * scale, f"gradient, {what}: |a - b| {error:.3e} against |b| {scale:.3e}"


@pytest.mark.parametrize("kind", KINDS)
def test_one_worker_equals_two_with_dropout_on(steps, kind):
    _same(steps[1][Scenario(kind).name], steps[2][Scenario(kind).name], f"{kind}: 1 worker x 2 chunks = 2 x 1")


@pytest.mark.parametrize("kind", KINDS)
def test_cached_embeddings_equal_the_direct_step(steps, kind):
    _same(steps[2][Scenario(kind, cached=True).name], steps[2][Scenario(kind).name], f"{kind} on 2 workers")


@pytest.mark.parametrize("direct, cached", [
    (Scenario("pairs", strategy="zero", zero=2), Scenario("pairs", strategy="zero", zero=2, cached=True)),
    (Scenario("triples", strategy="zero", zero=2), Scenario("triples", strategy="zero", zero=2, cached=True)),
    (Scenario("sentences_san", strategy="zero", zero=3), Scenario("sentences_san", strategy="zero", zero=3, cached=True)),
    (Scenario("pairs", chunk=2, model="qlora"), Scenario("pairs", chunk=2, model="qlora", cached=True)),
    (Scenario("pairs"), Scenario("pairs", strategy="zero", zero=0, cached=True)),
    (Scenario("pairs"), Scenario("pairs", strategy="zero", zero=1, cached=True)),
    (Scenario("sts", bf16=True), Scenario("sts", bf16=True, cached=True)),
    (Scenario("sts", bf16=True), Scenario("sts", strategy="zero", zero=2, bf16=True, cached=True)),
    (Scenario("groups"), Scenario("groups", strategy="zero", zero=2, cached=True)),
], ids=["zero-2", "zero-2 relation table", "zero-3 san", "qlora checkpointed", "zero-0", "zero-1", "bf16",
        "bf16 zero-2", "zero-2 query groups"])
def test_cached_embeddings_equal_the_direct_step_under_each_strategy(steps, direct, cached):
    _same(steps[2][cached.name], steps[2][direct.name], cached.name)


def test_deepspeed_trains_what_ddp_trains(steps):
    for kind in ("pairs", "triples"):
        _same(steps[2][Scenario(kind, strategy="zero", zero=2).name], steps[2][Scenario(kind).name], kind)
    _same(steps[2][Scenario("sentences_san", strategy="zero", zero=3).name], steps[2][Scenario("sentences_san").name],
          "zero-3")


def test_cached_embeddings_equal_the_direct_step_when_the_objective_leaves_an_embedding_unread(steps):
    direct, cached = Scenario("triplets", objective="angle_ibn"), Scenario("triplets", objective="angle_ibn", cached=True)
    for world in (1, 2):
        _same(steps[world][cached.name], steps[world][direct.name], f"{cached.name} on {world} worker(s)")
    _same(steps[2][direct.name], steps[1][direct.name], f"{direct.name}: 1 worker = 2")


def test_accumulated_cached_micro_batches_are_exact_on_two_workers(steps):
    scenario = Scenario("pairs", chunk=2, accum=2, cached=True)
    _same(steps[1][scenario.name], steps[2][scenario.name], scenario.name)


def test_the_comparison_sees_dropout_masks(steps):
    """Another chunking or another seed draws other masks: the losses above differ by far more than 1e-5 when masks do."""
    base = steps[1][Scenario("pairs").name]
    for other in (Scenario("pairs", chunk=8), Scenario("pairs", seed=8)):
        assert abs(steps[1][other.name][0] - base[0]) > 1e-3 * abs(base[0]), other.name


def test_query_and_document_sides_are_exact_and_encoded_as_sides(steps):
    """model.prompts and model.query_max_length: queries and documents in encode calls of their own (each with its
    length buckets), exact on 1 and 2 workers and cached; and the sides change what is trained."""
    sided = Scenario("triplets", sided=True)
    _same(steps[1][sided.name], steps[2][sided.name], f"{sided.name}: 1 worker = 2")
    _same(steps[2][Scenario("triplets", sided=True, cached=True).name], steps[2][sided.name], f"{sided.name} cached")
    plain = steps[1][Scenario("triplets").name]
    assert abs(steps[1][sided.name][0] - plain[0]) > 1e-3 * abs(plain[0])


def test_matryoshka_is_exact_on_gathered_embeddings(steps):
    """objective.matryoshka needs nothing of the step: 1 worker = 2 and cached = direct for query groups, and RSE's
    relation table cut with the embeddings under ZeRO-2; and it changes what is trained."""
    groups = Scenario("groups", matryoshka=True)
    _same(steps[1][groups.name], steps[2][groups.name], f"{groups.name}: 1 worker = 2")
    _same(steps[2][Scenario("groups", matryoshka=True, cached=True).name], steps[2][groups.name], "groups cached")
    triples = Scenario("triples", matryoshka=True)
    _same(steps[2][Scenario("triples", strategy="zero", zero=2, matryoshka=True, cached=True).name],
          steps[2][triples.name], "triples zero-2 cached")
    plain = steps[1][Scenario("groups").name]
    assert abs(steps[1][groups.name][0] - plain[0]) > 1e-3 * abs(plain[0])


@pytest.mark.parametrize("objective", ["distill_kl", "margin_mse"])
def test_distillation_from_group_teacher_scores_is_exact(steps, objective):
    """The teacher's scores travel with each drawn group (the positive's, then the drawn negatives', in the draw's
    order): 1 worker = 2 and cached = direct."""
    direct = Scenario("groups", objective=objective)
    _same(steps[1][direct.name], steps[2][direct.name], f"{direct.name}: 1 worker = 2")
    _same(steps[2][Scenario("groups", objective=objective, cached=True).name], steps[2][direct.name], "cached")
    assert steps[1][direct.name][0] > 0
