"""examples/elastic.py --fsdp: each process one replica, sharded over its devices
(``step_options={"fsdp_axes": "local"}``), through a kill, a restart and checkpoints.

Processes x 2 CPU devices on 127.0.0.1 (tests/multiprocess.py's run_launcher: a free
port, bounded in time, the whole process group killed at the end). What is checked
against something independent: the losses of the run without the layout (one replica a
device: post-local SGD's node-local replicas are identical, so the numbers are the same
up to the order of float sums), also when its checkpoint is resumed in that layout; the
bytes each device holds (about half: two devices a replica); and a bitwise resume, with
model state, from a checkpoint saved by the sharded layout.

Model state is not compared across layouts: with one replica a process it is computed
from the process's rows, with one replica a device from each device's (averaged only
when the models are), so the two layouts' model states differ by design.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from multiprocess import ROOT, run_launcher

# several processes with collective timeouts: one such job at a time (conftest)
pytestmark = [
    pytest.mark.xdist_group("processes"),
    pytest.mark.skipif(sys.platform != "linux", reason="needs Linux processes"),
]
SCRIPT = ROOT / "examples" / "elastic.py"


def launch(tmp_path, name, processes, steps, *args, timeout=180.0):
    """One launcher run; returns (exit code, records, output)."""
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--processes", str(processes)]
    cmd += ["--devices-per-process", "2", "--steps", str(steps), "--json", str(out)]
    cmd += ["--start", "4", "--period", "4", "--timeout", str(timeout - 20), *args]
    code, _, text = run_launcher(cmd, timeout)
    records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return code, records, text


def losses(records, process, live):
    return {
        r["step"]: r["loss"]
        for r in records
        if r["process"] == process and "step" in r and r["live_processes"] == live
    }


def finals(records):
    return {r["process"]: r for r in records if r.get("final")}


def test_sharded_replicas_train_like_whole_ones_through_a_kill_and_a_restart(tmp_path):
    # With a delayed average (delay 1) in both layouts.
    code, whole, out = launch(tmp_path, "whole", 2, 12, "--delay", "1")
    assert code == 0, out[-3000:]
    ckpt = tmp_path / "ckpt"
    args = ("--fsdp", "--delay", "1", "--kill", "1@12", "--restart", "1@13", "--step-time", "0.2")
    args += ("--checkpoint-dir", str(ckpt), "--checkpoint-every", "4")
    code, sharded, out = launch(tmp_path, "sharded", 2, 24, *args)
    assert code == 0, out[-3000:]
    assert "joined" in out, out[-3000:]  # process 1 came back and was healed
    # Steps 0-11 (global gradient means to 4, then none; averages start at 4 and 8 and
    # land a step later): the same losses as one replica a device.
    want, got = losses(whole, 0, [0, 1]), losses(sharded, 0, [0, 1])
    assert sorted(want) == list(range(12)) and set(range(12)) <= set(got), (want, got)
    np.testing.assert_allclose([got[s] for s in range(12)], [want[s] for s in range(12)], 1e-5)
    # Process 1 came back and finished with process 0: one model.
    fin = finals(sharded)
    assert sorted(fin) == [0, 1], out[-3000:]
    assert fin[0]["consensus_sha256"] == fin[1]["consensus_sha256"]
    assert any(s > 13 for s in losses(sharded, 1, [0, 1]) | losses(sharded, 1, [1, 0]))
    # Each device holds half a replica's params, momentum and averager state (the biases
    # of 64 and 10 split too; a few scalar counters stay whole).
    ratio = fin[0]["state_bytes_per_device"] / finals(whole)[0]["state_bytes_per_device"]
    assert 0.5 <= ratio < 0.52, ratio
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert saved == [4, 8, 12, 16, 20], saved
    # Its checkpoint of step 4 (the replicas equal after the global gradient means),
    # resumed with one replica a device: steps 4-11 as the run without the layout.
    (ckpt_4 := tmp_path / "ckpt4").mkdir()
    (ckpt / "4").rename(ckpt_4 / "4")
    args = ("--delay", "1", "--checkpoint-dir", str(ckpt_4), "--checkpoint-every", "100")
    code, resumed, out = launch(tmp_path, "resumed", 2, 12, *args)
    assert code == 0 and "resuming at step 4 from checkpoint" in out, out[-3000:]
    got = losses(resumed, 0, [0, 1])
    assert sorted(got) == list(range(4, 12)), got
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], 1e-5)


def test_a_sharded_checkpoint_with_model_state_resumes_bitwise(tmp_path):
    # One process: the one-node case (the step's means over one replica); model state
    # (a running mean of each replica's inputs, sharded like the params) and aux. A job
    # that resumes at step 6 ends where the first ended, bit for bit.
    args = ("--fsdp", "--model-state", "--checkpoint-dir", str(tmp_path / "ckpt"))
    args += ("--checkpoint-every", "3")
    a_code, a, a_out = launch(tmp_path, "a", 1, 9, *args)
    assert a_code == 0, a_out[-3000:]
    b_code, b, b_out = launch(tmp_path, "b", 1, 9, *args)
    assert b_code == 0, b_out[-3000:]
    assert sorted(losses(a, 0, [0])) == list(range(9))
    assert sorted(losses(b, 0, [0])) == [6, 7, 8]
    for key in ("consensus_sha256", "model_state_sha256"):
        assert finals(a)[0][key] == finals(b)[0][key]
    assert finals(a)[0]["model_state_spread"] == 0.0  # one replica: it is the consensus
    for step in (6, 7, 8):
        assert losses(b, 0, [0])[step] == losses(a, 0, [0])[step]
    assert all(r["aux"]["seen"] == r["step"] for r in a + b if "step" in r)
