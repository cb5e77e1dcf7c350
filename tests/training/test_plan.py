import numpy as np
import pytest

from training.plan import elastic_chunk, permuted, plan_steps


def test_steps_split_the_global_batch_over_workers_and_accumulation():
    plan = plan_steps(1000, world=2, global_batch=64, grad_accum=2, epochs=3, warmup_ratio=0.1)
    assert plan.micro_batch == 16  # 64 pairs = 2 workers x 2 micro-batches x 16
    assert plan.steps_per_epoch == 1000 // 64 == 15  # the 40 remainder rows sit out that pass
    assert plan.total_steps == 45 and plan.warmup_steps == 4


def _step_rows(plan, seed, step):
    """Per micro-batch, the rows of all workers concatenated in rank order (what the gather gives every worker)."""
    return [np.concatenate([plan.micro_rows(seed, step, m, r) for r in range(plan.world)])
            for m in range(plan.grad_accum)]


@pytest.mark.parametrize("world, accum", [(2, 1), (4, 2), (2, 4)])
def test_workers_gather_exactly_the_micro_batches_of_one_worker_at_every_step(world, accum):
    one = plan_steps(120, world=1, global_batch=32, grad_accum=accum, max_steps=12)
    many = plan_steps(120, world=world, global_batch=32, grad_accum=accum, max_steps=12)
    assert many.micro_batch * world == one.micro_batch
    for step in range(12):  # 3 steps per epoch: crosses 3 epoch boundaries with 24 remainder rows each
        for a, b in zip(_step_rows(one, 7, step), _step_rows(many, 7, step)):
            np.testing.assert_array_equal(a, b)


def test_each_epoch_is_a_seeded_permutation_without_repeats():
    plan = plan_steps(120, world=2, global_batch=32, grad_accum=2, max_steps=6)
    epoch0 = np.concatenate([np.concatenate(_step_rows(plan, 7, s)) for s in range(3)])
    assert len(set(epoch0.tolist())) == 96  # 3 full global batches, no row twice
    epoch1 = np.concatenate([np.concatenate(_step_rows(plan, 7, s)) for s in range(3, 6)])
    assert not np.array_equal(epoch0, epoch1)  # reshuffled per epoch
    np.testing.assert_array_equal(plan.epoch_order(7, 1), plan.epoch_order(7, 1))  # a pure function of (seed, epoch)
    assert not np.array_equal(plan.epoch_order(7, 0), plan.epoch_order(8, 0))


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 1000, 4097])
def test_the_keyed_permutation_is_one_and_its_entries_are_computed_alone(rows):
    whole = permuted(np.arange(rows), rows, 7, 2)
    assert sorted(whole.tolist()) == list(range(rows))  # every row once, at any size (cycle walking)
    picks = np.array([rows - 1, 0, rows // 2])
    np.testing.assert_array_equal(permuted(picks, rows, 7, 2), whole[picks])  # a slice without the rest


def test_the_keyed_permutation_puts_a_row_anywhere_with_equal_chance():
    """Row 0's place over 20,000 seeds is uniform over 10 places (a chi-square test at 1e-3)."""
    places = np.array([permuted(np.arange(10), 10, seed, 0)[0] for seed in range(20_000)])
    counts = np.bincount(places, minlength=10)
    assert ((counts - 2000) ** 2 / 2000).sum() < 27.88  # chi-square with 9 degrees of freedom, p = 0.001


def test_max_steps_overrides_epochs():
    assert plan_steps(1000, world=1, global_batch=100, epochs=5, max_steps=7).total_steps == 7


@pytest.mark.parametrize(
    "kwargs, key",
    [({"global_batch": 30, "world": 4}, "trainer.global_batch_size"), ({"global_batch": 512, "world": 1}, "larger"),
     ({"global_batch": 32, "world": 2, "chunk_size": 3}, r"trainer.chunk_size \(3\) must divide .* = 16")],
)
def test_impossible_numbers_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        plan_steps(100, **kwargs)


def test_the_remainder_rows_of_a_pass_sit_it_out_and_are_not_carried_to_the_next():
    """120 rows in steps of 32: 24 rows sit out each pass; the next pass starts a fresh permutation, not with them."""
    plan = plan_steps(120, world=2, global_batch=32, max_steps=6)
    passes = [np.concatenate([np.concatenate(_step_rows(plan, 7, s)) for s in range(e * 3, e * 3 + 3)]) for e in (0, 1)]
    left_out = set(range(120)) - set(passes[0].tolist())
    assert len(left_out) == 24
    assert not left_out <= set(passes[1][:24].tolist())  # not first in line in the next pass
    assert left_out != set(range(120)) - set(passes[1].tolist())  # a different remainder sits out the next pass


def test_a_chunk_has_one_place_in_its_step_on_any_worker_count():
    """Chunk c of a step holds the step's rows [c * chunk, (c + 1) * chunk) whoever encodes it: its dropout seed."""
    for world, accum in ((1, 1), (2, 1), (4, 1), (2, 2), (1, 4)):
        plan = plan_steps(64, world=world, global_batch=32, grad_accum=accum, chunk_size=4, max_steps=2)
        step_rows = plan_steps(64, world=1, global_batch=32, chunk_size=4, max_steps=2).micro_rows(7, 1, 0, 0)
        for micro in range(accum):
            for rank in range(world):
                rows = plan.micro_rows(7, 1, micro, rank)
                for k in range(plan.chunks_per_micro):
                    c = plan.chunk_index(micro, rank, k)
                    assert rows[k * 4:(k + 1) * 4].tolist() == step_rows[c * 4:(c + 1) * 4].tolist()
    assert plan_steps(64, world=2, global_batch=32).chunk_size == 16  # unset: a worker's micro-batch


def test_an_elastic_run_keeps_its_chunks_on_every_worker_count():
    """[1, 4] workers: the chunk is fixed, so every count from 1 to 4 holds whole chunks, and a smaller group's plan
    takes the same rows in the same chunks. Unset, it is a worker's micro-batch at the largest count."""
    assert elastic_chunk(24, (1, 2), 1) == 12
    with pytest.raises(ValueError, match=r"\[1, 4\] \(elastic\) may run on 3 workers.*chunk_size unset: 12"):
        elastic_chunk(48, (1, 4), 1)  # 4 chunks of 12 do not split among 3 workers
    chunk = elastic_chunk(48, (1, 4), 1, chunk_size=4)
    big = plan_steps(96, world=4, global_batch=48, chunk_size=chunk, max_steps=2)
    for world in (1, 2, 3):
        small = big.for_world(world)
        assert (small.world, small.micro_batch, small.chunk_size) == (world, 48 // world, 4)
        taken = np.concatenate([small.micro_rows(7, 1, 0, r) for r in range(world)])
        assert taken.tolist() == np.concatenate([big.micro_rows(7, 1, 0, r) for r in range(4)]).tolist()
        assert small.chunk_index(0, world - 1, small.chunks_per_micro - 1) == 11  # the step's last chunk
