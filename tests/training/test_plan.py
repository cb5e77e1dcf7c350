import pytest

from training.plan import plan_steps


def test_steps_split_the_global_batch_over_workers_and_accumulation():
    plan = plan_steps(1000, world=2, global_batch=64, grad_accum=2, epochs=3, warmup_ratio=0.1)
    assert plan.micro_batch == 16  # 64 pairs = 2 workers x 2 micro-batches x 16
    assert plan.steps_per_epoch == (500 // 16) // 2 == 15
    assert plan.total_steps == 45 and plan.warmup_steps == 4
    assert plan.position(17) == (1, 4)  # epoch 1, 2 steps x 2 micro-batches already consumed


def test_max_steps_overrides_epochs():
    assert plan_steps(1000, world=1, global_batch=100, epochs=5, max_steps=7).total_steps == 7


@pytest.mark.parametrize(
    "kwargs, key",
    [({"global_batch": 30, "world": 4}, "trainer.global_batch_size"), ({"global_batch": 512, "world": 1}, "larger")],
)
def test_impossible_numbers_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        plan_steps(100, **kwargs)
