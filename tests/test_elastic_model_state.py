"""examples/elastic.py --model-state --delay 1: model state, aux and a delayed average
through a kill and a restart.

Three processes x 2 CPU devices on 127.0.0.1 (a free port, bounded in time, the whole
process group killed at the end: tests/multiprocess.py's run_launcher). Process 2 is
killed as the step where a delayed average lands starts (the mean in flight lives in the
optimizer state each step returns, so the retried step over the survivors lands it), and
restarted: it joins with the survivors' mean model state.
"""

from __future__ import annotations

import sys

import pytest
from test_elastic import finals, launch, steps_of

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux processes")

# start_localSGD_iter 4, period 4, delay 1: averages start at 4, 8, ... and land one step
# later; the last step (40) starts one, and the model state averages when it starts.
STEPS = 41


def test_model_state_and_aux_survive_a_kill_and_a_restart(tmp_path):
    args = ("--model-state", "--delay", "1", "--start", "4", "--period", "4")
    args += ("--kill", "2@9", "--restart", "2@12", "--step-time", "0.15")
    code, _, records, out = launch(tmp_path, *args, steps=STEPS, timeout=240.0)
    assert code == 0, out[-3000:]
    check_model_state_run(records, out)


def check_model_state_run(records, out):
    """What a run with model state, aux and a delay went through (see the test)."""
    for p in (0, 1):
        assert steps_of(records, p) == list(range(STEPS))
    mine = steps_of(records, 2)
    gaps = [s for a, s in zip(mine, mine[1:]) if s != a + 1]
    assert len(gaps) == 1, f"process 2 did not come back once: {mine}\n{out[-3000:]}"
    first_back = gaps[0]
    assert mine[mine.index(first_back) :] == list(range(first_back, STEPS)), mine
    # The aux reached every record: the count of steps in the model state is the step
    # on every replica (a restarted one got the survivors' model state, not a fresh one).
    steps = [r for r in records if "step" in r]
    assert all("aux" in r for r in steps), steps[:3]
    assert all(r["aux"]["seen"] == r["step"] for r in steps), [r for r in steps][-3:]
    assert all(r["aux"]["fresh"] == (6 if r["step"] == 0 else 0) for r in steps)
    live = {r["step"]: 2 * len(r["live_processes"]) for r in steps}
    assert all(0 <= r["aux"]["correct"] <= 16 * live[r["step"]] for r in steps)
    back = [r for r in steps if r["step"] == first_back]
    assert {r["process"] for r in back} == {0, 1, 2}
    # One model and one model state everywhere; after the last step's average every
    # replica holds the mean model state (to rounding: the consensus is a jnp.mean, the
    # average a psum over replicas; unaveraged, the replicas are ~1e-2 apart).
    fin = finals(records)
    assert sorted(fin) == [0, 1, 2], out[-3000:]
    for key in ("consensus_sha256", "model_state_sha256"):
        assert len({fin[p][key] for p in fin}) == 1, fin
    assert all(fin[p]["model_state_spread"] < 1e-6 for p in fin), fin
    assert all(fin[p]["test_accuracy"] > 0.8 for p in fin), fin
