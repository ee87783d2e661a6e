"""examples/elastic.py: processes die, stall and come back; the others keep training.

Each test starts the launcher (3 processes x 2 CPU devices on 127.0.0.1, a free port),
bounds it in time, and kills its whole process group at the end, so every worker is
reaped whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from multiprocess import ROOT, worker_env

SCRIPT = ROOT / "examples" / "elastic.py"
STEPS = 24
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux processes")


def launch(tmp_path, *args, steps=STEPS, timeout=150.0):
    """Runs the launcher; returns (exit code, seconds, records, output)."""
    out = tmp_path / "run.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--processes", "3", "--devices-per-process", "2"]
    cmd += ["--steps", str(steps), "--json", str(out), "--timeout", str(timeout - 20), *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=worker_env(),
        cwd=ROOT,
        start_new_session=True,  # its own process group: the workers go with it
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"the launcher did not end in {timeout} s:\n{text.decode()[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return proc.returncode, time.monotonic() - t0, records, text.decode(errors="replace")


def steps_of(records, process):
    return [r["step"] for r in records if r["process"] == process and "step" in r]


def finals(records):
    return {r["process"]: r for r in records if r.get("final")}


def check_finished_together(records, processes, out):
    fin = finals(records)
    assert sorted(fin) == sorted(processes), out[-3000:]
    assert len({fin[p]["consensus_sha256"] for p in processes}) == 1  # one model
    assert all(fin[p]["test_accuracy"] > 0.8 for p in processes), fin


def test_an_undisturbed_run_agrees_on_one_model(tmp_path):
    code, _, records, out = launch(tmp_path)
    assert code == 0, out[-3000:]
    for p in range(3):
        assert steps_of(records, p) == list(range(STEPS))
    assert all(r["recovery_s"] is None for r in records if "step" in r)
    assert all(r["live_processes"] == [0, 1, 2] for r in records if "step" in r)
    check_finished_together(records, [0, 1, 2], out)
