"""The plan's compute: each candidate's kinds of step timed from their compiled programs
(fake timings keyed by program: deterministic), each charged its own compute in the
prediction, within a budget decided alike on every process."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_2x4

import lsgd_jax
from lsgd_jax.planner import CANDIDATES, Link, _compute, _plan, plan, predict

N = 4096
WARMUP_THIRD = next(c for c in CANDIDATES if c.name.endswith("warm-up to 1/3"))


def loss_fn(p, b):
    return jnp.mean((b @ p) ** 2)


def built(candidate=WARMUP_THIRD, num_steps=30):
    """A candidate's step, ``() -> its arguments``, its ledger, ``{id(Compiled): phase}``."""
    mesh = mesh_2x4()
    tx = candidate.make(optax.sgd(0.1), num_steps)
    step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)

    def args():
        return (lsgd_jax.replicate(jnp.zeros(N), mesh),
                lsgd_jax.replicate(tx.init(jnp.zeros(N)), mesh), jnp.ones((8, N)))  # fmt: skip

    ledger = lsgd_jax.communication_ledger(step, *args(), num_steps=num_steps)
    programs = {id(c): k for k, c in step.programs_of(*args(), num_steps=num_steps)}
    return step, args, ledger, programs


def fake_timed(programs, seconds_of):
    """``timed`` whose every program takes ``seconds_of(phase)`` (the local step: 0.05)."""
    calls = []

    def timed(call, args, repeats, warm=3, clock=None):
        phase = programs.get(id(call), "local")
        calls.append(phase)
        return 0.05 if phase == "local" else seconds_of(phase)

    return timed, calls


def test_each_kind_of_step_is_timed_less_its_predicted_link_seconds(monkeypatch):
    step, args, ledger, programs = built()
    assert len(ledger.phases) == 3  # the warm-up, the local step, the average
    timed, calls = fake_timed(programs, lambda k: 0.1 + 0.01 * k)
    monkeypatch.setattr(_compute, "timed", timed)
    link_s = {k: 0.002 * (k + 1) for k in ledger.phases}
    found, left = _compute.phase_compute(step, args, ledger, link_s, 60.0, 0.1, 5)
    assert found == {k: pytest.approx(0.1 + 0.01 * k - link_s[k]) for k in ledger.phases}
    assert sorted(calls) == sorted(ledger.phases)
    per_call = _compute.PHASE_WARM + 5
    assert left == pytest.approx(60.0 - per_call * sum(0.1 + s for s in link_s.values()))
    # a step faster than its predicted link time: its compute is 0, not below
    monkeypatch.setattr(_compute, "timed", fake_timed(programs, lambda k: 0.001)[0])
    found, _ = _compute.phase_compute(step, args, ledger, link_s, 60.0, 0.1, 5)
    assert set(found.values()) == {0.0}


def test_a_step_of_one_program_is_timed_as_the_ledgers_one_kind(monkeypatch):
    bare = lsgd_jax.planner.Candidate("bare", lambda opt, n: optax.chain(opt), 0.0, "mine")
    step, args, ledger, programs = built(bare)
    assert list(ledger.phases) == ["ddp"] and list(programs.values()) == ["switch"]
    monkeypatch.setattr(_compute, "timed", fake_timed(programs, lambda k: 0.07)[0])
    found, _ = _compute.phase_compute(step, args, ledger, {"ddp": 0.01}, 60.0, 0.05, 3)
    assert found == {"ddp": pytest.approx(0.06)}


def test_a_kind_too_slow_or_past_the_budget_is_left_to_the_local_compute(monkeypatch):
    step, args, ledger, programs = built()
    timed, calls = fake_timed(programs, lambda k: 0.2)
    monkeypatch.setattr(_compute, "timed", timed)
    phases = list(ledger.phases)
    link_s = dict.fromkeys(phases, 0.0)
    link_s[phases[0]] = _compute.PHASE_CAP_S  # predicted over the cap with the compute
    per_call = _compute.PHASE_WARM + 4
    found, left = _compute.phase_compute(step, args, ledger, link_s, 0.15 * per_call, 0.1, 4)
    assert list(found) == [phases[1]] and calls == [phases[1]]  # then the budget is spent
    assert left == pytest.approx(0.05 * per_call)
    assert _compute.phase_compute(step, args, ledger, link_s, 0.0, 0.1, 4) == ({}, 0.0)


def test_the_timed_calls_are_what_the_budget_affords_every_kind_within_bounds():
    low, high = _compute.PHASE_REPEATS
    warm, cap = _compute.PHASE_WARM, _compute.PHASE_CAP_S
    kinds = [{0: 0.0, 1: 0.1}, {0: 0.0}, {0: cap}]  # 0.1 + 0.2 + 0.1 s a call (one over cap)
    assert _compute.phase_repeats(0.4 * (warm + 5), 0.1, kinds) == 5
    assert _compute.phase_repeats(1e6, 0.1, kinds) == high
    # fewer than the least for every kind: none timed (a table timed in part would not
    # compare its candidates alike)
    assert _compute.phase_repeats(0.4 * (warm + low) - 0.01, 0.1, kinds) == 0
    assert _compute.phase_repeats(0.4 * (warm + low), 0.1, kinds) == low
    assert _compute.phase_repeats(1.0, 0.1, [{0: cap}]) == high  # nothing to time


def test_the_plan_charges_each_kind_of_step_its_own_compute(monkeypatch):
    """On the measured link (here a fake probe's) each kind of step is timed: the warm-up
    at 80 ms, the others at 50 ms; the prediction is that, its link seconds included."""
    link = Link(1e12, 0.001)
    monkeypatch.setattr(_plan, "measure_link", lambda *a, **k: (link, []))
    seen = {}  # the plan's own programs, as its steps hand them out
    programs_of = lsgd_jax.DataParallelStep.programs_of

    def recording(self, *args, **kwargs):
        out = programs_of(self, *args, **kwargs)
        seen.update({id(c): k for k, c in out})
        return out

    monkeypatch.setattr(lsgd_jax.DataParallelStep, "programs_of", recording)
    warmup = built(WARMUP_THIRD)[2].steps[0]  # the run starts with its warm-up
    timed, _ = fake_timed(seen, lambda k: 0.08 if k == warmup else 0.05)
    monkeypatch.setattr(_compute, "timed", timed)
    monkeypatch.setattr(_compute, "call_overhead", lambda *a, **k: 0.004)  # a call's own
    found = plan(
        loss_fn,
        jnp.zeros(N),
        jnp.ones((8, N)),
        mesh_2x4(),
        optax.sgd(0.1),
        num_steps=30,
        tolerance=0.05,
        candidates=[CANDIDATES[0], WARMUP_THIRD],
    )
    row = next(r for r in found.rows if r.name == WARMUP_THIRD.name)
    assert sorted(row.timed_phases) == sorted(row.phase_step_s)
    assert sorted(round(v, 6) for v in row.phase_step_s.values()) == [0.054, 0.054, 0.084]
    assert found.call_overhead_s == 0.004
    assert "(every kind of step timed on the mesh, 30 calls each," in str(found)
    assert found.timed_calls == 30 and found.phase_budget_s == 60.0
    # a budget too small for 3 calls of every kind: none timed, and the table says so
    small = plan(loss_fn, jnp.zeros(N), jnp.ones((8, N)), mesh_2x4(), optax.sgd(0.1),
                 num_steps=30, tolerance=0.05, candidates=[CANDIDATES[0], WARMUP_THIRD],
                 phase_budget_s=0.01)  # fmt: skip
    assert all(r.timed_phases == () for r in small.rows) and small.timed_calls == 0
    assert small.call_overhead_s == 0.0  # nothing timed: the local step's compute has it
    assert "no kind of step timed: phase_budget_s=0.01 affords fewer than 3" in str(small)
    # a budget of 0: every kind charged the local step's compute (50 ms less its link)
    found = plan(loss_fn, jnp.zeros(N), jnp.ones((8, N)), mesh_2x4(), optax.sgd(0.1),
                 num_steps=30, tolerance=0.05, candidates=[CANDIDATES[0], WARMUP_THIRD],
                 phase_budget_s=0)  # fmt: skip
    assert all(r.timed_phases == () for r in found.rows)
    assert found.rows[0].phase_compute_s == dict.fromkeys(found.rows[0].phase_step_s,
                                                          found.compute_s)  # fmt: skip


def test_a_given_link_or_compute_times_nothing_and_a_bad_budget_is_refused(monkeypatch):
    kwargs = dict(num_steps=30, tolerance=0.05, candidates=[CANDIDATES[0], WARMUP_THIRD])
    args = (loss_fn, jnp.zeros(N), jnp.ones((8, N)), mesh_2x4(), optax.sgd(0.1))
    found = plan(*args, link=Link(12.5e6, 0.001), **kwargs)  # the compute measured
    assert all(r.timed_phases == () for r in found.rows)
    with pytest.raises(ValueError, match="phase_budget_s is seconds, >= 0; got -1"):
        plan(*args, phase_budget_s=-1, **kwargs)
    with pytest.raises(TypeError, match="phase_budget_s"):
        plan(*args, phase_budget_s="60", **kwargs)


def test_predict_takes_a_compute_for_each_kind_of_step_and_names_one_missing():
    _, _, ledger, _ = built()
    link = Link(1e12, 0.0)
    compute = {k: 0.01 * (k + 1) for k in ledger.phases}
    seconds = predict(ledger, link, compute)
    assert [round(s, 6) for s in seconds] == [0.01 * (k + 1) for k in ledger.steps]
    with pytest.raises(ValueError, match=r"missing \[1\], not phases \[\]"):
        predict(ledger, link, {k: v for k, v in compute.items() if k != 1})
    with pytest.raises(ValueError, match=r"missing \[\], not phases \['14 B'\]"):
        predict(ledger, link, {**compute, "14 B": 0.1})  # a Row's label is not a phase
    with pytest.raises(ValueError, match="compute_s is seconds, >= 0"):
        predict(ledger, link, dict.fromkeys(ledger.phases, -0.1))


def test_a_model_the_step_refuses_is_refused_before_the_probe(monkeypatch):
    def probe(*args, **kwargs):
        raise AssertionError("probed the link before checking the model")

    monkeypatch.setattr(_plan, "measure_link", probe)
    params = {"w": jnp.zeros(N), "n": jnp.array(3, jnp.int32)}  # an int leaf: not a param
    with pytest.raises(TypeError, match=r"^plan: .*leaf \['n'\] is an int32 array of shape \(\)"):
        plan(lambda p, b: loss_fn(p["w"], b), params, jnp.ones((8, N)), mesh_2x4(),
             optax.sgd(0.1), num_steps=30, tolerance=0.05)  # fmt: skip


def test_the_processes_calls_are_pooled_not_the_slowest_median(monkeypatch):
    """Two processes whose calls alternate fast and slow (each waits on the other in
    turn): the agreed step is the median of all their calls, not the slower median."""
    from jax.experimental import multihost_utils

    from lsgd_jax.planner import _link

    mine = [0.10, 0.10, 0.10, 0.30, 0.30]  # this process: median 0.10
    theirs = [0.30, 0.30, 0.30, 0.10, 0.20]  # the other: median 0.30
    monkeypatch.setattr(_link.jax, "process_count", lambda: 2)
    monkeypatch.setattr(
        multihost_utils, "process_allgather", lambda x: np.stack([np.asarray(x), theirs])
    )
    assert _link.pooled_median(mine) == pytest.approx(0.25)  # ten calls: (0.2 + 0.3) / 2
    theirs = 0.30  # the link probe keeps the slowest process's seconds
    assert _link.slowest(0.10) == pytest.approx(0.30)
    monkeypatch.setattr(_link.jax, "process_count", lambda: 1)
    assert _link.pooled_median(mine) == pytest.approx(0.10)


def test_a_call_through_the_step_is_timed_against_its_program():
    """A step of three kinds called in turn through the step and through the program of
    its next call, across its phases (26 calls of a 30-step run; fake clock: 3 s
    through the step, 1 s as the program): the difference, from real calls."""
    step, args, ledger, _ = built()
    ticks = iter([0, 3, 3, 4] * 13)
    assert _compute.call_overhead(step, args(), 10, clock=lambda: next(ticks)) == 2.0
    ticks = iter([0, 1, 1, 4] * 13)  # a program slower than the call: 0, not below
    assert _compute.call_overhead(step, args(), 10, clock=lambda: next(ticks)) == 0.0
    local, fresh = _compute.local_step(loss_fn, jnp.zeros(N), jnp.ones((8, N)), mesh_2x4(),
                                       optax.sgd(0.1))  # fmt: skip
    assert 0 <= _compute.call_overhead(local, fresh(), 3) < 1.0  # real clocks
