"""examples/elastic.py --fsdp: each process one replica, sharded over its devices
(``step_options={"fsdp_axes": "local"}``), through a kill, a restart and checkpoints.

Processes x 2 CPU devices on 127.0.0.1 (tests/multiprocess.py's run_launcher: a free
port, bounded in time, the whole process group killed at the end). What is checked
against something independent: the losses of the run without the layout (one replica a
device: post-local SGD's node-local replicas are identical, so the numbers are the same
up to the order of float sums), the bytes each device holds (about half: two devices a
replica), and a bitwise resume from a checkpoint saved by the sharded layout.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from multiprocess import ROOT, run_launcher

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux processes")
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
    code, whole, out = launch(tmp_path, "whole", 2, 12)
    assert code == 0, out[-3000:]
    args = ("--fsdp", "--kill", "1@12", "--restart", "1@13", "--step-time", "0.2")
    args += ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4")
    code, sharded, out = launch(tmp_path, "sharded", 2, 24, *args)
    assert code == 0, out[-3000:]
    assert "joined" in out, out[-3000:]  # process 1 came back and was healed
    # Steps 0-11 (global gradient means to 4, then none; averages at 4 and 8): the same
    # losses as one replica a device.
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
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert saved == [4, 8, 12, 16, 20], saved


def test_a_sharded_checkpoint_resumes_bitwise_and_onto_whole_replicas(tmp_path):
    # One process: the one-node case (the step's means over one replica), then a job
    # that resumes at step 6 and ends where the first ended, bit for bit; and one replica
    # a device (two replicas, resized from the checkpoint's one) from the same
    # checkpoint: the same losses.
    ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3")
    runs = {}
    for job, layout in (("a", ("--fsdp",)), ("b", ("--fsdp",)), ("c", ())):
        code, records, out = launch(tmp_path, job, 1, 9, *layout, *ckpt)
        assert code == 0, out[-3000:]
        runs[job] = records
    a, b, c = runs["a"], runs["b"], runs["c"]
    assert sorted(losses(a, 0, [0])) == list(range(9))
    assert sorted(losses(b, 0, [0])) == sorted(losses(c, 0, [0])) == [6, 7, 8]
    assert finals(a)[0]["consensus_sha256"] == finals(b)[0]["consensus_sha256"]
    for step in (6, 7, 8):
        assert losses(b, 0, [0])[step] == losses(a, 0, [0])[step]
        np.testing.assert_allclose(losses(c, 0, [0])[step], losses(a, 0, [0])[step], 1e-5)
