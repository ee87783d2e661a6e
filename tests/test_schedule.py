"""Schedules as values: the rule, its replay, and the counter past int32, against plain
Python (PyTorch's rules written out in tests/helpers.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import torch_hierarchical_level, torch_periodic_level
from hypothesis import given, settings
from hypothesis import strategies as st

import lsgd_jax

INT32_MAX = 2**31 - 1


@settings(max_examples=40, deadline=None, derandomize=True)
@given(period=st.integers(1, 9), warmup=st.integers(0, 12))
def test_periodic_replay_is_pytorchs_rule(period, warmup):
    schedule = lsgd_jax.PeriodicSchedule(period, warmup)
    want = [torch_periodic_level(s, period, warmup) for s in range(60)]
    assert schedule.replay(60).tolist() == want
    traced = [int(schedule.level(jnp.int32(s))) for s in range(0, 60, 7)]
    assert traced == want[::7]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(periods=st.sets(st.integers(1, 12), min_size=1, max_size=3), warmup=st.integers(0, 12))
def test_hierarchical_replay_is_pytorchs_rule(periods, warmup):
    periods = tuple(sorted(periods))
    schedule = lsgd_jax.HierarchicalSchedule(periods, warmup)
    want = [torch_hierarchical_level(s, periods, warmup) for s in range(60)]
    assert schedule.replay(60).tolist() == want
    assert [schedule.is_global(k) for k in range(len(periods) + 1)] == [False] * len(periods) + [
        True
    ]
    assert schedule.cycle == np.lcm.reduce(periods)


def test_adaptive_replay_follows_the_last_average():
    schedule = lsgd_jax.AdaptiveSchedule(lambda s: jnp.where(s < 10, 2, 5), warmup_steps=3)
    levels, last = [], 0
    for s in range(30):  # the rule, written out
        period = 2 if s < 10 else 5
        hit = s >= 3 and (s == 3 or s - last >= period)
        levels.append(int(hit))
        last = s if hit else last
    assert schedule.replay(30).tolist() == levels
    assert schedule.cycle is None and schedule.tracks_last_sync


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["periodic", "fragments", "hierarchical"]),
    period=st.integers(1, 12),
    warmup=st.integers(0, 40),
    back=st.integers(0, 30),
)
def test_the_counter_past_int32_keeps_the_level_of_the_true_step(kind, period, warmup, back):
    if kind == "periodic":
        schedule = lsgd_jax.PeriodicSchedule(period, warmup)
    elif kind == "fragments":
        schedule = lsgd_jax.PeriodicSchedule(2 * period, warmup, fragments=2)
    else:
        schedule = lsgd_jax.HierarchicalSchedule((period, 2 * period + 1), warmup)
    step, true = jnp.int32(INT32_MAX - back), INT32_MAX - back
    for _ in range(back + 40):
        assert int(schedule.level(step)) == schedule.level(true)  # the true, unbounded rule
        step, true = schedule.next_step(step, "test"), true + 1
    assert 0 <= int(step) <= INT32_MAX


def test_the_averagers_hold_their_schedules():
    avg = lsgd_jax.PeriodicModelAverager(6, warmup_steps=2, fragments=3)
    assert avg.sync_schedule == lsgd_jax.PeriodicSchedule(6, 2, 3)
    assert avg.schedule(20).tolist() == avg.sync_schedule.replay(20).tolist()
    hier = lsgd_jax.HierarchicalModelAverager({2: "local", 8: ("node", "local")}, 4)
    assert hier.sync_schedule == lsgd_jax.HierarchicalSchedule((2, 8), 4)
    assert hier.cycle == 8 and hier.num_levels == 2
    adaptive = lsgd_jax.PeriodicModelAverager(lambda s: 4)
    assert isinstance(adaptive.sync_schedule, lsgd_jax.AdaptiveSchedule)
    with pytest.raises(TypeError, match="use averager.schedule"):
        adaptive.level(3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: lsgd_jax.PeriodicSchedule(0), "period must be a positive int"),
        (lambda: lsgd_jax.PeriodicSchedule(6, fragments=4), "divisible"),
        (lambda: lsgd_jax.HierarchicalSchedule((4, 2)), "strictly increasing"),
        (lambda: lsgd_jax.PeriodicSchedule(4, warmup_steps=-1), "non-negative"),
    ],
)
def test_bad_schedules_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()
