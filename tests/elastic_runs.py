"""Running examples/elastic.py from a test: the launcher with a time bound, its records."""

from __future__ import annotations

import json
import sys

from multiprocess import ROOT, run_launcher

SCRIPT = ROOT / "examples" / "elastic.py"
STEPS = 24
GLOO_ABORT = "gloo::EnforceNotMet"


def launch(tmp_path, *args, steps=STEPS, timeout=150.0):
    """Runs the launcher; returns (exit code, seconds, records, output)."""
    for attempt in range(2):
        out = tmp_path / f"run{attempt}.jsonl"
        cmd = [sys.executable, str(SCRIPT), "--processes", "3", "--devices-per-process", "2"]
        cmd += ["--steps", str(steps), "--json", str(out), "--timeout", str(timeout - 20), *args]
        code, seconds, records, text = run_records(cmd, out, timeout)
        # Gloo can abort a survivor whose collective met the dead peer (docs/failures.md,
        # a known limitation, ~1 in 20 injected failures here); when that survivor is
        # process 0 the run ends. Run such a scenario once more, and say so.
        kills_0 = any(str(a).startswith("0@") for a in args)
        if kills_0 or not (GLOO_ABORT in text and "process 0 aborted" in text):
            break
        print(f"gloo aborted process 0 (known limitation); running {args} again")
    return code, seconds, records, text


def run_records(cmd, out, timeout):
    """Runs the launcher ``cmd`` (writing its records to ``out``); returns (exit code,
    seconds, records, output)."""
    code, seconds, text = run_launcher(cmd, timeout)
    records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return code, seconds, records, text


def steps_of(records, process):
    return [r["step"] for r in records if r["process"] == process and "step" in r]


def finals(records):
    return {r["process"]: r for r in records if r.get("final")}
