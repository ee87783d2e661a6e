"""Schedules as values: the rule, its replay, and the counter past int32, against plain
Python (PyTorch's rules written out in tests/helpers.py)."""

import jax
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


def _near_the_maximum(averager, back):
    """``tx.init`` of the averaging alone, its step counter ``back`` calls below the
    int32 maximum (the step of the last average one before)."""
    state = lsgd_jax.model_averaging(averager).init({})
    first = INT32_MAX - back
    last = None if state.last_sync is None else jnp.int32(first - 1)
    return state.replace(step=jnp.int32(first), last_sync=last)


def test_replays_stop_where_the_counter_of_a_callable_period_stops():
    # numpy's "OverflowError: Python integer 2147483648 out of bounds for int32" came
    # from period(jnp.int32(step)) once a replay looked past the maximum; the device
    # raised the library's own message only at the call at the maximum.
    averager = lsgd_jax.PeriodicModelAverager(lambda s: jnp.where(s < 100, 2, 2**31 - 10))
    state = _near_the_maximum(averager, 5)
    assert lsgd_jax.replay_phases(state, 5).tolist() == [0] * 5  # every call that can run
    with pytest.raises(OverflowError) as info:
        lsgd_jax.replay_phases(state, 10)
    message = str(info.value)
    assert message.startswith(
        "replaying 10 calls from step 2147483642: call 6, at step 2147483647, cannot run. "
        "PeriodicModelAverager (AdaptiveSchedule(period=<lambda>)): the averager's step "
        "counter reached the int32 maximum"
    )
    assert "state.replace(step=state.step - k, last_sync=state.last_sync - k)" in message
    assert "use an int period" in message
    with pytest.raises(OverflowError, match=r"replaying 2147483649 calls from step 0: call"):
        averager.schedule(2**31 + 1)  # refused at once, not after 2**31 Python steps
    with pytest.raises(OverflowError, match=r"level\(2147483648\).*reached the int32 max"):
        averager.sync_schedule.level(2**31, 0)


def test_a_cycle_longer_than_the_counter_is_refused_where_the_device_refuses_it():
    # No replay error at all before: the host replayed calls past the maximum that the
    # device cannot run (its counter has no cycle to continue from).
    hier = lsgd_jax.HierarchicalModelAverager({2**16: "local", 2**16 + 1: None})
    state = _near_the_maximum(hier, 2)
    assert lsgd_jax.replay_phases(state, 2).shape == (2,)
    with pytest.raises(OverflowError, match=r"call 3, at step 2147483647.*cycle of 4295032832"):
        lsgd_jax.replay_phases(state, 3)
    assert not hier.sync_schedule.wraps and lsgd_jax.PeriodicModelAverager(4).sync_schedule.wraps


def test_a_callable_period_beyond_int32_is_read_as_never_again():
    # period(s) beyond int32 failed in the traced comparison (numpy's OverflowError);
    # any such period means the same thing as 2**31 - 1: no average before the counter
    # ends. One inside the user's own jnp code cannot be read, and says so.
    for never in (2**40, np.int64(2**31)):
        schedule = lsgd_jax.AdaptiveSchedule(lambda s, never=never: never, warmup_steps=1)
        assert schedule.replay(6).tolist() == [0, 1, 0, 0, 0, 0]
        assert int(jax.jit(schedule.level)(jnp.int32(INT32_MAX - 1), jnp.int32(1))) == 0
    inside = lsgd_jax.AdaptiveSchedule(lambda s: jnp.where(s < 4, 2, 2**31))
    with pytest.raises(OverflowError, match=r"period=<lambda> raised OverflowError at step 0.*"):
        inside.replay(6)
    with pytest.raises(OverflowError, match=r"return at most 2\*\*31 - 1 \(2147483647\)"):
        jax.jit(inside.level)(jnp.int32(5), jnp.int32(1))


# --- through the averagers' level, against PyTorch's rules over 3000 steps ------------


@pytest.mark.slow  # 3000 steps a draw, each draw compiled
@settings(max_examples=60, deadline=None)
@given(period=st.integers(1, 64), warmup=st.integers(0, 200))
def test_periodic_schedule_property(period, warmup):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        averager = lsgd_jax.PeriodicModelAverager(period, warmup)
    steps = np.arange(3000)
    want = [torch_periodic_level(int(s), period, warmup) for s in steps]
    assert [averager.level(int(s)) for s in steps] == want
    np.testing.assert_array_equal(jax.jit(averager.level)(jnp.asarray(steps, jnp.int32)), want)


@pytest.mark.slow  # 3000 steps a draw, each draw compiled
@settings(max_examples=60, deadline=None)
@given(
    periods=st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True).map(sorted),
    warmup=st.integers(0, 200),
)
def test_hierarchical_schedule_property(periods, warmup):
    import warnings

    axes = ["local", ("node", "local"), ("pod", "node", "local"), ("dc", "pod", "node", "local")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        averager = lsgd_jax.HierarchicalModelAverager(dict(zip(periods, axes)), warmup)
    steps = np.arange(3000)
    want = [torch_hierarchical_level(int(s), periods, warmup) for s in steps]
    assert [averager.level(int(s)) for s in steps] == want
    np.testing.assert_array_equal(jax.jit(averager.level)(jnp.asarray(steps, jnp.int32)), want)
