"""benchmarks/plan_link.py's table and benchmarks/delay_link.py's link with a round trip.

The benchmark itself (the planner against two emulated nodes, about 25 minutes) is not
run here; its summary is checked on a made-up record, and the delay relay, where root
can make namespaces, by timing a round trip through it."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT


def load(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pl = load("plan_link")


def run(name, steps, losses, predicted):
    return {"name": name, "step_s": steps, "loss": losses, "predicted_step_s": predicted}


def test_the_table_compares_each_run_and_the_picks_with_the_fastest():
    record = {
        "link": [12.5e6, 0.001], "flat_link": [6.25e6, 0.004], "link_s": 2.0, "plan_s": 9.0,
        "compute_s": 0.02, "top": ["local", "DDP"], "picks": {0.01: "DDP", 0.05: "local"},
        "runs": [
            run("local", [0.1] * 8, [4, 3, 2, 1, 1, 1, 1, 1], 0.11),  # its 5-step mean ends at 1
            run("DDP", [0.2] * 8, [4, 2, 2, 2, 2, 2, 2, 2], 0.16),  # ... at 2: the target
        ],
    }  # fmt: skip
    text = "\n".join(pl.summarize("100mbit@10ms", record))
    assert "Target loss 2.0000" in text
    # local's 5-step means: 4, 3.5, 3, 2.5, 2.2, 1.6: reaches 2 at step 6, 0.6 s;
    # DDP's: 4, 3, 2.67, 2.5, 2.4, 2.0: at step 6 too, 1.2 s
    assert "| local (top 1, pick at 0.05) | 110.0 | 100.0, 100.0 | +10% | 0.60 |" in text
    assert "| DDP (top 2, pick at 0.01) | 160.0 | 200.0, 200.0 | -20% | 1.20 |" in text
    assert re.search(r"pick at tolerance 0.01, DDP: 2.00x the fastest", text)
    assert re.search(r"pick at tolerance 0.05, local: 1.00x the fastest", text)
    assert pl.round_trip_ms("50ms") == 50.0 and pl.round_trip_ms("0.1") == 0.1
    with pytest.raises(ValueError, match="round trip"):
        pl.round_trip_ms("-1ms")


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2",
)
def test_the_relay_adds_its_round_trip_and_leaves_nothing_behind():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "delay_link.py"), "--check", "--prefix",
         "lsgdtdl", "--delay-ms", "10", "--rate", "100mbit"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip("no CAP_NET_ADMIN here")
    assert out.returncode == 0, out.stderr[-2000:]
    rtt = float(re.search(r"round trip ([\d.]+) ms", out.stdout).group(1))
    assert 20.0 <= rtt < 40.0  # 10 ms each way
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "lsgdtdl" not in names
