"""benchmarks/chaos.py --quick: a short failure soak (120 steps, 3 random events).

Every finishing process ends with the same model, no step is lost (only the failed
attempts are re-run), and every event is recovered from.
"""

from __future__ import annotations

import json
import sys

import pytest
from multiprocess import ROOT, run_launcher

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux processes")


def test_quick_soak(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--quick", "--no-baseline"]
    # kill 2@22, stop 1@44, kill 2@76. In one CI run the kill made gloo abort process 0
    # (docs/failures.md), process 1 went on alone and was then stopped while restarted 2
    # was joining: nobody held the model, and the run ended. Now 2 restarts from the
    # newest checkpoint (test_elastic_checkpoint.py's job C does this on purpose).
    cmd += ["--seed", "1"]
    cmd += ["--json", str(out), "--timeout", "400"]
    code, seconds, text = run_launcher(cmd, 460)
    assert code == 0, text[-4000:]
    res = json.loads(out.read_text())
    # (a gloo abort costs one finisher; the survivor runs the remaining steps in a few
    # seconds with no simulated compute, so a restart may find the run over)
    assert len(res["hashes"]) >= (1 if res["gloo_aborts"] else 2), res
    assert res["one_model"], res["hashes"]
    assert res["steps_lost"] == 0, res
    assert len(res["events"]) == 3
    assert all(e["recovered"] for e in res["events"]), res["events"]
