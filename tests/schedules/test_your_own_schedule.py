"""A schedule written by a user (issue 35): ``lsgd_jax.schedules.Schedule`` subclassed
with a ``level`` rule, passed as ``PeriodicModelAverager(period=...)``, through the step
builder, ``from_parts`` and a replay; the built-in schedules passed the same way give the
same averager as their int or callable period."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_2x4

import lsgd_jax
from lsgd_jax.schedules import AdaptiveSchedule, HierarchicalSchedule, PeriodicSchedule, Schedule


@dataclasses.dataclass(frozen=True)
class Shrinking(Schedule):
    """Every ``start`` steps, the period halving every ``every`` steps down to 1."""

    start: int = 4
    every: int = 6
    warmup_steps: int = 2
    tracks_last_sync = True

    def level(self, step, last_sync=None):
        period = jnp.maximum(self.start // 2 ** (step // self.every), 1)
        on = (step == self.warmup_steps) | (step - last_sync >= period)
        return ((step >= self.warmup_steps) & on).astype(jnp.int32)


def shrinking_callable(s):
    return jnp.maximum(4 // 2 ** (s // 6), 1)


def test_a_user_schedule_replays_like_the_same_rule_as_a_callable():
    mine = lsgd_jax.PeriodicModelAverager(Shrinking())
    same = lsgd_jax.PeriodicModelAverager(shrinking_callable, warmup_steps=2)
    np.testing.assert_array_equal(mine.schedule(40), same.schedule(40))
    assert mine.warmup_steps == 2 and mine.sync_schedule == Shrinking()
    assert mine._first_global_step(0) == 2
    assert mine.sync_schedule.num_phases == 2 and not mine.sync_schedule.wraps


def loss_fn(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def train(averager, steps=14):
    mesh = mesh_2x4()
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2, post_local_gradient_allreduce=False),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(averager),
    )
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (6, 8)) / 3, "w2": jax.random.normal(k2, (8, 1)) / 3}
    p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        batch = {"x": rng.standard_normal((64, 6), np.float32)}
        batch["y"] = rng.standard_normal((64, 1), np.float32)
        p, s, _ = step(p, s, batch)
    return p


@pytest.mark.parametrize("options", [{}, {"delta": True}], ids=["plain", "delta"])
def test_a_user_schedule_trains_through_the_step_like_its_callable_twin(options):
    # delta=True asks the schedule for its first global step while the step is traced
    mine = train(lsgd_jax.PeriodicModelAverager(Shrinking(), **options))
    twin = train(lsgd_jax.PeriodicModelAverager(shrinking_callable, warmup_steps=2, **options))
    jax.tree.map(np.testing.assert_array_equal, mine, twin)
    # step 13 averages (period 1 from step 12): the replicas agree
    for leaf in jax.tree.leaves(mine):
        leaf = np.asarray(leaf)
        np.testing.assert_allclose(leaf, np.broadcast_to(leaf[:1], leaf.shape), rtol=1e-6)


def test_from_parts_passes_any_schedule_through():
    avg = lsgd_jax.PeriodicModelAverager(Shrinking(), delta=True)
    back = lsgd_jax.averaging.from_parts(avg.parts)
    assert back == avg and back.sync_schedule == Shrinking()


def test_a_built_in_schedule_as_period_is_the_same_averager():
    by_schedule = lsgd_jax.PeriodicModelAverager(PeriodicSchedule(8, 4, fragments=2, delay=1))
    by_ints = lsgd_jax.PeriodicModelAverager(8, 4, fragments=2, delay=1)
    assert by_schedule == by_ints and by_schedule.period == 8
    adaptive = lsgd_jax.PeriodicModelAverager(AdaptiveSchedule(shrinking_callable, 2))
    assert adaptive == lsgd_jax.PeriodicModelAverager(shrinking_callable, 2)


def test_what_a_schedule_carries_is_not_given_twice():
    with pytest.raises(ValueError, match="warmup_steps=2, but warmup_steps=5 was given"):
        lsgd_jax.PeriodicModelAverager(Shrinking(), warmup_steps=5)
    assert lsgd_jax.PeriodicModelAverager(Shrinking(), warmup_steps=2).warmup_steps == 2
    with pytest.raises(TypeError, match="use HierarchicalModelAverager"):
        lsgd_jax.PeriodicModelAverager(HierarchicalSchedule((2, 4)))

    @dataclasses.dataclass(frozen=True)
    class TwoLevels(Shrinking):
        @property
        def num_levels(self):
            return 2

    with pytest.raises(ValueError, match="2 levels.*num_levels = 1"):
        lsgd_jax.PeriodicModelAverager(TwoLevels())


def test_a_schedule_without_a_rule_names_what_is_missing():
    @dataclasses.dataclass(frozen=True)
    class Empty(Schedule):
        pass

    with pytest.raises(NotImplementedError, match="Empty must define level"):
        lsgd_jax.PeriodicModelAverager(Empty())


@dataclasses.dataclass(frozen=True)
class EveryThird(Schedule):
    """A rule of the step alone (no last_sync), with a delay field."""

    delay: int = 0
    every: int = 3

    def level(self, step, last_sync=None):
        return (jnp.asarray(step) % self.every == 0).astype(jnp.int32)


def test_a_rule_that_reads_last_sync_must_say_so():
    @dataclasses.dataclass(frozen=True)
    class Untracked(Schedule):
        def level(self, step, last_sync=None):
            return ((step - last_sync) >= 2).astype(jnp.int32)

    with pytest.raises(TypeError, match="set tracks_last_sync = True"):
        lsgd_jax.PeriodicModelAverager(Untracked())


def test_a_level_outside_its_range_is_refused_by_the_replay():
    @dataclasses.dataclass(frozen=True)
    class Two(Schedule):
        def level(self, step, last_sync=None):
            return jnp.where(jnp.asarray(step) % 2 == 0, 2, 0)

    with pytest.raises(
        ValueError, match=r"level\(0\) returned .*from 0 \(no average\) to num_levels \(1\)"
    ):
        lsgd_jax.PeriodicModelAverager(Two())


def test_a_delay_belongs_to_the_schedule_and_keeps_one_average_in_flight():
    delayed = lsgd_jax.PeriodicModelAverager(EveryThird(delay=1))
    assert delayed.delay == 1 and delayed.sync_schedule.num_phases == 4
    want = lsgd_jax.PeriodicModelAverager(3, delay=1)
    np.testing.assert_array_equal(delayed.schedule(12), want.schedule(12))
    with pytest.raises(ValueError, match="closer than delay=3"):
        lsgd_jax.PeriodicModelAverager(EveryThird(delay=3))
    with pytest.raises(ValueError, match="delay=1 belongs to the schedule"):
        lsgd_jax.PeriodicModelAverager(Shrinking(), delay=1)

    @dataclasses.dataclass(frozen=True)
    class TrackedDelay(Shrinking):
        delay: int = 1

    with pytest.raises(ValueError, match="needs a rule of the step alone"):
        lsgd_jax.PeriodicModelAverager(TrackedDelay())


def test_a_schedule_is_a_frozen_dataclass_instance():
    with pytest.raises(TypeError, match="pass an instance, period=Shrinking()"):
        lsgd_jax.PeriodicModelAverager(Shrinking)

    @dataclasses.dataclass
    class Loose(Schedule):
        def level(self, step, last_sync=None):
            return jnp.asarray(step) % 2

    with pytest.raises(TypeError, match="frozen dataclass"):
        lsgd_jax.PeriodicModelAverager(Loose())
