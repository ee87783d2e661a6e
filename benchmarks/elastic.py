"""What a failure costs an elastic run: recovery time, steps lost, final accuracy.

Runs ``examples/elastic.py`` (3 processes x 2 CPU devices, digits MLP, post-local SGD)
undisturbed and with one failure of each kind, several times, and prints a table::

    python benchmarks/elastic.py --reps 3 --steps 300

Recovery is the time from the start of the first attempt at the step that met the
failure (or the new membership) to that step's completion on the survivors, as the
loop records it (``StepRecord.recovery_s``). Steps lost: steps some survivor never
completed (the failed attempt is retried, so the goal is none).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCENARIOS = {
    "undisturbed": [],
    "dies between steps": ["--die", "2@{k}:between"],
    "dies inside a step (mid-collective)": ["--die", "2@{k}:inside"],
    "SIGKILL by the launcher": ["--kill", "2@{k}"],
    "SIGSTOP (stuck)": ["--stall", "2@{k}"],
    "SIGKILL, restarted 10 steps later": ["--kill", "2@{k}", "--restart", "2@{r}"],
    "stuck in Python (watchdog 10 s)": ["--die", "2@{k}:hang", "--stall-timeout", "10"],
    "two kills, two restarts, one more kill": [
        "--kill",
        "2@{k}",
        "--restart",
        "2@{r}",
        "--kill",
        "1@{k2}",
        "--restart",
        "1@{r2}",
        "--kill",
        "2@{k3}",
    ],
}


def run(name: str, steps: int, step_time: float) -> dict:
    k = steps // 3
    marks = {"k": k, "r": k + 10, "k2": 2 * k - 30, "r2": 2 * k - 20, "k3": 2 * k + 30}
    extra = [a.format(**marks) for a in SCENARIOS[name]]
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "run.jsonl"
        cmd = [sys.executable, str(ROOT / "examples" / "elastic.py"), "--processes", "3"]
        cmd += ["--devices-per-process", "2", "--steps", str(steps), "--json", str(out)]
        cmd += ["--step-time", str(step_time), "--timeout", "400", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=460)
        records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    finals = {r["process"]: r for r in records if r.get("final")}
    steps_done = {}
    for r in records:
        if "step" in r:
            steps_done.setdefault(r["process"], set()).add(r["step"])
    # Steps lost: steps a process that ran to the end never completed, counted from its
    # last (re)join (a joiner skips the steps it was away by design).
    lost = 0
    for p in finals:
        done = sorted(steps_done.get(p, ()))
        back = max([s for a, s in zip(done, done[1:]) if s != a + 1] or [0])
        lost += len(set(range(back, steps)) - set(done))
    recoveries = [r["recovery_s"] for r in records if r.get("recovery_s") is not None]
    return {
        "scenario": name,
        "exit": proc.returncode,
        "recovery_s": max(recoveries) if recoveries else None,
        "steps_lost": lost,
        "one_model": len({f["consensus_sha256"] for f in finals.values()}) == 1,
        "processes_at_end": len(finals),
        "accuracy": (
            statistics.mean(f["test_accuracy"] for f in finals.values()) if finals else None
        ),
        "log_tail": "" if proc.returncode == 0 else proc.stdout[-3000:] + proc.stderr[-3000:],
    }


def overhead(reps: int, steps: int) -> None:
    """What the elastic loop costs an undisturbed step: the same training with
    ``data_parallel_step`` alone (``--plain``) and through the loop, alternated."""
    times: dict[str, list[float]] = {"plain": [], "elastic": []}
    for _ in range(reps):
        for mode in times:
            cmd = [sys.executable, str(ROOT / "examples" / "elastic.py"), "--processes", "3"]
            cmd += ["--devices-per-process", "2", "--steps", str(steps)]
            cmd += ["--plain"] if mode == "plain" else []
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400)
            line = next(x for x in proc.stdout.splitlines() if x.startswith("TIMING "))
            times[mode].append(float(line.split()[1]))
            print(f"  {mode}: {times[mode][-1]:.2f} ms/step", flush=True)
    plain, loop = statistics.median(times["plain"]), statistics.median(times["elastic"])
    print()
    print(
        "| data_parallel_step alone (ms/step) | through ElasticLoop (ms/step) | ratio "
        "| added (ms) |"
    )
    print("|---:|---:|---:|---:|")
    print(f"| {plain:.2f} | {loop:.2f} | {loop / plain:.2f} | {loop - plain:.2f} |")


def rejoin(reps: int, steps: int, step_time: float) -> None:
    """How long a restarted trainer takes from its start to its first step, without the
    persistent compilation cache and with it (warm: the trainer's first life, and the
    other trainers, wrote the programs it needs), alternated."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    compiled: dict[str, list[int]] = {"off": [], "on": []}
    k = steps // 3
    for _ in range(reps):
        for mode in times:
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "run.jsonl"
                cache = "off" if mode == "off" else str(pathlib.Path(tmp) / "cache")
                cmd = [sys.executable, str(ROOT / "examples" / "elastic.py"), "--processes"]
                cmd += ["3", "--devices-per-process", "2", "--steps", str(steps), "--json"]
                cmd += [str(out), "--step-time", str(step_time), "--kill", f"2@{k}"]
                cmd += ["--restart", f"2@{k + 10}", "--compilation-cache", cache]
                env = {n: v for n, v in os.environ.items() if not n.startswith("JAX_")}
                subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=460, env=env)
                mine = [json.loads(x) for x in out.read_text().splitlines()]
                mine = [r for r in mine if r.get("process") == 2 and "step" in r]
            # its second life: the records after its clock restarted
            second = next(
                (
                    i
                    for i in range(1, len(mine))
                    if mine[i]["since_start_s"] < mine[i - 1]["since_start_s"]
                ),
                None,
            )
            if second is not None:
                first, last = mine[second], mine[-1]
                times[mode].append(first["since_start_s"])
                compiled[mode].append(last["compiles"])
                print(
                    f"  cache {mode}: first step {first['since_start_s']:.2f} s after the "
                    f"restart; {last['compiles']} programs compiled in its second life",
                    flush=True,
                )
    print()
    print(
        "| persistent compilation cache | restart to first step (s), median [min, max] | "
        "programs the restarted trainer compiled |"
    )
    print("|---|---|---|")
    for mode, ts in times.items():
        if ts:
            print(
                f"| {mode} | {statistics.median(ts):.2f} [{min(ts):.2f}, {max(ts):.2f}] | "
                f"{compiled[mode]} |"
            )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--overhead", action="store_true", help="only time undisturbed steps, loop or not"
    )
    ap.add_argument(
        "--rejoin",
        action="store_true",
        help="only time a restarted trainer's rejoin, with and without the compilation cache",
    )
    args = ap.parse_args(argv)
    if args.rejoin:
        rejoin(args.reps, args.steps, args.step_time)
        return
    if args.overhead:
        overhead(args.reps, args.steps)
        return
    rows = []
    for name in SCENARIOS:
        for rep in range(args.reps):
            row = run(name, args.steps, args.step_time)
            shown = {k: v for k, v in row.items() if k != "log_tail"}
            print(f"  {name}, rep {rep}: {shown}", flush=True)
            if row["log_tail"]:
                print(row["log_tail"], flush=True)
            rows.append(row)
    print()
    print(
        "| scenario | exit 0 | recovery (s), median [min, max] | steps lost | one model | "
        "processes at the end | test accuracy (mean) |"
    )
    print("|---|---:|---|---:|---|---:|---:|")
    for name in SCENARIOS:
        rs = [r for r in rows if r["scenario"] == name]
        rec = [r["recovery_s"] for r in rs if r["recovery_s"] is not None]
        rec_text = f"{statistics.median(rec):.2f} [{min(rec):.2f}, {max(rec):.2f}]" if rec else "-"
        accs = [r["accuracy"] for r in rs if r["accuracy"] is not None]
        print(
            f"| {name} | {sum(r['exit'] == 0 for r in rs)}/{len(rs)} | {rec_text} | "
            f"{sum(r['steps_lost'] for r in rs)} | {all(r['one_model'] for r in rs)} | "
            f"{statistics.median(r['processes_at_end'] for r in rs):.0f} | "
            f"{100 * statistics.mean(accs):.1f} |"
            if accs
            else "- |"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
