"""lsgd_jax.planner's candidates: each quality curve as issue 34's records give it, and
the share of a run a candidate needs to get within a tolerance of a tuned DDP."""

import optax
import pytest
from helpers import load_example

from lsgd_jax.planner import CANDIDATES, Candidate


def reach_by_hand(curve, tolerance):
    """Where the curve (points at 1/n, 2/n, ..., 1 of the run) first gets to the
    tolerance, linear between its points; None if it never does."""
    n = len(curve)
    for i, gap in enumerate(curve):
        if gap <= tolerance:
            if i == 0:
                return 1 / n
            before = curve[i - 1]
            return (i + (before - tolerance) / (before - gap)) / n
    return None


def test_the_curves_are_issue_34s_records():
    sweep = load_example("lm_sweep", folder="benchmarks")
    curves = sweep.reach_curves(sweep.OUT)
    assert {c.name for c in CANDIDATES} == set(curves)
    for c in CANDIDATES:
        assert c.curve == curves[c.name] and c.risk == c.curve[-1], c.name
        assert len(c.curve) == 15 and c.curve[0] > 1  # steps 100..1500; the start is far
    ddp = next(c for c in CANDIDATES if c.name == "DDP")
    assert ddp.risk == 0.0 and ddp.reach(0.0) == 1.0


def test_reach_is_where_the_curve_first_gets_within_the_tolerance():
    for c in CANDIDATES:
        for tolerance in (0.0, 0.005, 0.01, 0.02, 0.0383, 0.05, 0.1, 0.5, 2.0):
            assert c.reach(tolerance) == pytest.approx(reach_by_hand(c.curve, tolerance)), (
                c.name,
                tolerance,
            )
    bumpy = Candidate("bumpy", lambda o, n: o, 0.02, "here", curve=(0.3, 0.01, 0.2, 0.02))
    assert bumpy.reach(0.01) is None  # it ends above: the risk decides
    assert bumpy.reach(0.05) == pytest.approx((1 + 0.25 / 0.29) / 4)  # the first crossing
    assert Candidate("end", lambda o, n: o, 0.02, "here").reach(0.05) == 1.0  # no curve
    assert Candidate("x", lambda o, n: o, None, "here").reach(1.0) is None  # not measured


def test_a_bad_curve_is_refused_with_the_fix():
    make = lambda o, n: optax.chain(o)  # noqa: E731
    with pytest.raises(ValueError, match=r"give risk=curve\[-1\]"):
        Candidate("c", make, 0.01, "here", curve=(0.5, 0.02))
    with pytest.raises(ValueError, match=r"give risk=curve\[-1\]"):
        Candidate("c", make, None, "here", curve=(0.5, 0.02))
    with pytest.raises(TypeError, match="non-empty tuple of gaps"):
        Candidate("c", make, 0.01, "here", curve=())
    with pytest.raises(TypeError, match="curve"):
        Candidate("c", make, 0.01, "here", curve=("0.5", 0.01))


def test_a_curve_may_be_a_numpy_array():
    import numpy as np

    c = Candidate("c", lambda o, n: o, 0.01, "here", curve=np.array([0.5, 0.01]))
    assert c.curve == (0.5, 0.01) and c.reach(0.01) == 1.0
