"""examples/elastic.py --model-state --delay 1 --comm int4: model state, aux, a delayed
average and 4-bit averages with error feedback through a kill and a restart.

Three processes x 2 CPU devices on 127.0.0.1 (a free port, bounded in time, the whole
process group killed at the end: tests/multiprocess.py's run_launcher). Process 2 is
killed as the step where a delayed average lands starts (the mean in flight lives in the
optimizer state each step returns, so the retried step over the survivors lands it), and
restarted: it joins with the survivors' mean model state. A second test saves
checkpoints with model state in one job and resumes them in the next.
"""

from __future__ import annotations

import json
import sys

import pytest
from elastic_runs import finals, launch, steps_of

# several processes with collective timeouts: one such job at a time (conftest)
pytestmark = [
    pytest.mark.xdist_group("processes"),
    pytest.mark.skipif(sys.platform != "linux", reason="needs Linux processes"),
]

# start_localSGD_iter 4, period 4, delay 1: averages start at 4, 8, ... and land one step
# later; the last step (40) starts one, and the model state averages when it starts.
STEPS = 41


def test_model_state_and_aux_survive_a_kill_and_a_restart(tmp_path):
    # With 4-bit two-level averages too, whose error-feedback residual is per replica (a
    # joiner starts with zero, test_elastic_pieces.py): one launch for what was also a
    # test of its own in test_elastic.py.
    args = ("--model-state", "--delay", "1", "--start", "4", "--period", "4", "--comm", "int4")
    args += ("--kill", "2@9", "--restart", "2@12", "--step-time", "0.15")
    # a collective that waits out one process compiling a new phase on a busy machine
    # (with 5 s it once timed out; its retry now gets a new device order, but the
    # timeout would still cost a retry per phase)
    args += ("--collective-timeout", "15")
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


def test_model_state_is_checkpointed_and_resumed(tmp_path):
    # Job A (1 process x 2 devices) saves at steps 3 and 6 and runs to 9; job B resumes
    # from step 6 of the same folder: the same model and model state as A's (bitwise),
    # and its first step already counts 6 steps in the model state (restored, not fresh).
    from multiprocess import ROOT, run_launcher

    ckpt = tmp_path / "ckpt"
    runs = {}
    for job in ("a", "b"):
        out = tmp_path / f"{job}.jsonl"
        cmd = [sys.executable, str(ROOT / "examples" / "elastic.py"), "--processes", "1"]
        cmd += ["--devices-per-process", "2", "--steps", "9", "--json", str(out)]
        cmd += ["--model-state", "--start", "2", "--period", "2", "--delay", "1"]
        cmd += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--timeout", "100"]
        code, _, text = run_launcher(cmd, 120.0)
        assert code == 0, text[-3000:]
        runs[job] = [json.loads(x) for x in out.read_text().splitlines()]
    a, b = runs["a"], runs["b"]
    assert steps_of(a, 0) == list(range(9)) and steps_of(b, 0) == [6, 7, 8]
    assert all(r["aux"]["seen"] == r["step"] for r in a + b if "step" in r)
    fa, fb = finals(a)[0], finals(b)[0]
    for key in ("consensus_sha256", "model_state_sha256"):
        assert fa[key] == fb[key], (fa, fb)
    texts = [p.read_text(errors="replace") for p in (ckpt / "6").rglob("*") if p.is_file()]
    assert any('"model_state"' in t or "'model_state'" in t for t in texts)
    # A loop without model state refuses that checkpoint, saying what to pass (it said
    # "Build the target exactly as the saved tree was built", about a tree it never saw).
    cmd = [sys.executable, str(ROOT / "examples" / "elastic.py"), "--processes", "1"]
    cmd += ["--devices-per-process", "2", "--steps", "12", "--start", "2", "--period", "2"]
    cmd += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--timeout", "100"]
    code, _, text = run_launcher(cmd, 120.0)
    assert code != 0
    assert "differ in model state (this loop has no model state" in text, text[-3000:]
    assert 'step_options={"with_model_state": True} both, or neither' in text
