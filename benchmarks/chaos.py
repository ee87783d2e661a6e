"""A failure soak with goodput: many random failures in one elastic run.

Runs ``examples/elastic.py`` (N processes x 2 CPU devices, digits MLP, post-local SGD,
the coordinator in a process of its own, checkpoints on) twice: first undisturbed, then
with ``--events`` random failures drawn from ``--seed`` and spread over the run::

    python benchmarks/chaos.py --steps 600 --events 12 --processes 3 --seed 0

Event kinds (each on a random process, process 0 included):

- ``kill``: SIGKILL (the launcher's ``--kill P@K``), restarted a few steps later
  (``--restart P@K2``);
- ``stop``: SIGSTOP (``--stall P@K``) for longer than the heartbeat timeout, then
  SIGCONT from this script (it finds the trainer's PID in ``/proc``), and a restart a
  few steps later once that process has exited (the others declared it dead);
- ``job``: SIGKILL of the coordinator process (``--kill-coordinator K``, at most once):
  the launcher restarts it and the whole job, which resumes from the newest checkpoint
  (``--max-restarts 1``); the steps since that checkpoint are re-run.

It prints a table and writes ``--json``: goodput (the undisturbed run's wall time over
this run's, same steps: useful steps per second relative to no failures), per event the
recovery (the loop's ``recovery_s`` on the survivors' first step after it; for a restart,
seconds from the restart to the process's first completed step), steps lost (steps a
finishing process never completed since its last (re)join, beyond the re-run ones),
steps re-run, gloo aborts (SIGABRT exits the launcher reported), every finishing
process's consensus SHA-256 and the test accuracy against the undisturbed run's.
``--baseline-json FILE`` reuses an undisturbed run's record instead of running one
(``--save-baseline FILE`` writes it). ``--quick``: 120 steps, 3 events (the test).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import slow_link  # noqa: E402  (the emulated link's namespaces, for --slow-link)


def schedule(
    steps: int,
    events: int,
    processes: int,
    seed: int,
    first: int = 20,
    kinds: tuple[str, ...] = ("kill", "stop", "job"),
) -> list[dict]:
    """``events`` failures drawn from ``seed``: one per equal slot of ``[first, steps -
    tail)``, at a random step of the slot's first half; a kind, a process, and (for a
    kill or a stop) the step of its restart, a few steps later."""
    rng = random.Random(seed)
    tail = max(30, steps // 5)
    slot = (steps - tail - first) / events
    if slot < 8:
        raise SystemExit(f"chaos.py: {events} events do not fit in {steps} steps")
    job = events >= 6 and "job" in kinds
    job_at = rng.randrange(events // 3, events - events // 3) if job else None
    out, last = [], None
    for i in range(events):
        at = int(first + i * slot + rng.randrange(0, max(1, int(slot / 2))))
        if i == job_at:
            out.append({"kind": "job", "process": None, "step": at})
            continue
        p = rng.choice([q for q in range(processes) if q != last])  # not the one just hit
        last = p
        kind = rng.choice([k for k in ("kill", "stop") if k in kinds])
        out.append({"kind": kind, "process": p, "step": at, "restart": at + rng.randint(3, 6)})
    return out


def _flags(events: list[dict]) -> list[str]:
    flags = []
    for e in events:
        if e["kind"] == "job":
            flags += ["--kill-coordinator", str(e["step"])]
        else:
            flags += ["--kill" if e["kind"] == "kill" else "--stall", f"{e['process']}@{e['step']}"]
            flags += ["--restart", f"{e['process']}@{e['restart']}"]
    return flags


def _trainer_pid(process: int, records: pathlib.Path) -> int | None:
    """The PID of the stopped trainer ``process`` (state T) of the run writing
    ``records``, from /proc."""
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (
            state == "T"
            and str(EXAMPLE).encode() in cmd
            and str(records).encode() in cmd
            and b"--process-id" in cmd
            and cmd[cmd.index(b"--process-id") + 1] == str(process).encode()
        ):
            return int(d.name)
    return None


def run(args, events: list[dict], tmp: pathlib.Path, name: str) -> dict:
    """One launcher run; its log lines and step records, each stamped when seen."""
    records_path = tmp / f"{name}.jsonl"
    ckpt = tmp / f"{name}-ckpt"
    cmd = [sys.executable, str(EXAMPLE), "--processes", str(args.processes)]
    cmd += ["--devices-per-process", "2", "--steps", str(args.steps)]
    cmd += ["--step-time", str(args.step_time), "--json", str(records_path)]
    cmd += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(args.checkpoint_every)]
    cmd += ["--max-restarts", "1", "--timeout", str(args.timeout), *_flags(events)]
    cmd += ["--heartbeat", str(args.heartbeat)]
    cmd += ["--collective-timeout", str(args.collective_timeout)]
    link = None
    if args.slow_link:  # one trainer per namespace; the coordinator in the first
        cmd += ["--netns", ",".join(slow_link.namespaces())]
        cmd += ["--coordinator-host", slow_link.addresses()[0]]
        link = slow_link.link_bytes()
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    records: list[tuple[float, dict]] = []
    offset, seen, conts = 0, 0, []  # conts: (when, process) SIGCONTs due
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > args.timeout + 60:
                proc.kill()
                break
            if records_path.exists():
                with open(records_path) as f:
                    f.seek(offset)
                    for line in f:
                        if not line.endswith("\n"):
                            break
                        offset += len(line)
                        records.append((time.monotonic() - t0, json.loads(line)))
            for t, line in lines[seen:]:
                if line.startswith("elastic.py: stopped process "):
                    conts.append((t + args.stop_s, int(line.split()[3])))
            seen = len(lines)
            for due, p in list(conts):
                if time.monotonic() - t0 >= due:
                    pid = _trainer_pid(p, records_path)
                    if pid is not None:
                        os.kill(pid, signal.SIGCONT)
                    lines.append((time.monotonic() - t0, f"chaos.py: SIGCONT process {p} ({pid})"))
                    conts.remove((due, p))
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher ends and reaps its children
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()
        reader.join(timeout=10)
    wall = time.monotonic() - t0
    if records_path.exists():  # the lines written after the last poll
        with open(records_path) as f:
            f.seek(offset)
            records += [(wall, json.loads(x)) for x in f if x.endswith("\n")]
    sent = slow_link.link_bytes() - link if link is not None else None
    return {
        "exit": proc.returncode,
        "wall_s": wall,
        "lines": lines,
        "records": records,
        "link_bytes": sent,
    }


def _evaluate(args, events: list[dict], out: dict) -> dict:
    recs = [r for _, r in out["records"]]
    finals = {r["process"]: r for r in recs if r.get("final")}
    done: dict[int, list[int]] = {}
    for r in recs:
        if "step" in r:
            done.setdefault(r["process"], []).append(r["step"])
    lost = rerun = 0
    for p, ss in done.items():
        rerun += len(ss) - len(set(ss))  # completed twice: re-run after a job restart
        if p in finals:
            s = sorted(set(ss))
            back = max([b for a, b in zip(s, s[1:]) if b != a + 1] or [0])
            lost += len(set(range(back, args.steps)) - set(s))
    lines = out["lines"]
    # The launcher's own lines, in order, each with the step and time it was seen at.
    log = []
    for t, line in lines:
        w = line.split()
        if line.startswith(("elastic.py: killed process", "elastic.py: stopped process")):
            log.append(("down", int(w[3]), int(w[-1]), t))
        elif line.startswith("elastic.py: restarted process"):
            log.append(("restart", int(w[3]), int(w[-1]), t))
        elif line.startswith("elastic.py: killed the coordinator"):
            log.append(("job", None, int(w[-1]), t))
    rows = []
    for e in events:
        row = dict(e)
        if e["kind"] == "job":
            hit = next((x for x in log if x[0] == "job"), None)
            row["injected_at"] = hit[2] if hit else None
            after = [t for t, r in out["records"] if hit and t > hit[3] and "step" in r]
            row["recovery_s"] = (min(after) - hit[3]) if after else None
            row["recovered"] = bool(after)
            rows.append(row)
            continue
        p = e["process"]
        down = next((x for x in log if x[0] == "down" and x[1] == p and x[2] >= e["step"]), None)
        row["injected_at"] = down[2] if down else None
        if down is None:
            row["recovered"] = False
            rows.append(row)
            continue
        log.remove(down)
        # The survivors' first step completed without p, after the event.
        surv = [
            (t, r)
            for t, r in out["records"]
            if "step" in r and t >= down[3] and r["process"] != p and p not in r["live_processes"]
        ]
        rec = [r["recovery_s"] for _, r in surv[:8] if r.get("recovery_s") is not None]
        row["recovery_s"] = max(rec) if rec else None
        row["recovered"] = bool(surv)
        back = next((x for x in log if x[0] == "restart" and x[1] == p and x[3] >= down[3]), None)
        if back is not None:
            log.remove(back)
            joined = [
                t for t, r in out["records"] if "step" in r and r["process"] == p and t >= back[3]
            ]
            row["restarted_at"] = back[2]
            row["rejoin_s"] = (min(joined) - back[3]) if joined else None
        rows.append(row)
    hashes = {p: f["consensus_sha256"] for p, f in finals.items()}
    return {
        "exit": out["exit"],
        "wall_s": out["wall_s"],
        "events": rows,
        "steps_lost": lost,
        "steps_rerun": rerun,
        "gloo_aborts": sum("aborted (SIGABRT)" in line for _, line in lines),
        "hashes": hashes,
        "one_model": len(set(hashes.values())) == 1,
        "link_bytes": out.get("link_bytes"),
        "accuracy": statistics.mean(f["test_accuracy"] for f in finals.values())
        if finals
        else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--events", type=int, default=12)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="120 steps, 3 events")
    ap.add_argument(
        "--kinds", default="kill,stop,job", help="event kinds to draw from (comma-separated)"
    )
    ap.add_argument("--step-time", type=float, default=0.0, help="simulated compute (s/step)")
    ap.add_argument(
        "--heartbeat", type=int, default=10, help="heartbeat timeout (s; loose for a loaded host)"
    )
    ap.add_argument("--collective-timeout", type=int, default=20, help="seconds")
    ap.add_argument(
        "--stop-s", type=float, default=None, help="SIGSTOP to SIGCONT (s; heartbeat + 5)"
    )
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="no undisturbed run (no goodput, no accuracy comparison)",
    )
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=1800.0, help="each run (s)")
    ap.add_argument("--baseline-json", default=None, help="an undisturbed run's record")
    ap.add_argument("--save-baseline", default=None, help="write the undisturbed run's record")
    ap.add_argument("--json", default=None)
    ap.add_argument("--log", default=None, help="write the disturbed run's whole output here")
    ap.add_argument(
        "--slow-link",
        default=None,
        metavar="RATE",
        help="run the two trainers (--processes 2) in benchmarks/slow_link.py's two network "
        "namespaces, joined by a veth pair capped at RATE (e.g. 100mbit; root only)",
    )
    args = ap.parse_args(argv)
    if args.slow_link:
        return _on_slow_link(args, argv)
    return _soak(args, argv)


def _on_slow_link(args, argv) -> int:
    """The soak with the two trainers on the emulated link (set up, and always torn
    down, here)."""
    missing = slow_link.requirements()
    if missing or args.processes != 2:
        why = "; ".join(missing) or f"--processes 2 (one per namespace), got {args.processes}"
        raise SystemExit(f"chaos.py --slow-link needs {why}")
    slow_link.teardown()  # a killed run's leftovers
    try:
        slow_link.setup()
        slow_link.set_rate(args.slow_link)
        return _soak(args, argv)
    finally:
        slow_link.teardown()


def _soak(args, argv) -> int:
    if args.stop_s is None:
        args.stop_s = args.heartbeat + 5.0
    if args.quick:
        args.steps, args.events = 120, 3
    kinds = tuple(args.kinds.split(","))
    events = schedule(args.steps, args.events, args.processes, args.seed, kinds=kinds)
    print(f"chaos.py: events {json.dumps(events)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        if args.baseline_json:
            base = json.loads(pathlib.Path(args.baseline_json).read_text())
        elif args.no_baseline:
            base = {"wall_s": None, "accuracy": None, "hashes": {}, "exit": None}
        else:
            raw = run(args, [], tmp, "baseline")
            base = _evaluate(args, [], raw)
            print(f"chaos.py: undisturbed run {json.dumps(base)}", flush=True)
            if base["exit"] != 0:
                print("\n".join(line for _, line in raw["lines"][-60:]), flush=True)
            if args.save_baseline:
                pathlib.Path(args.save_baseline).write_text(json.dumps(base, indent=1))
        out = run(args, events, tmp, "chaos")
    res = _evaluate(args, events, out)
    if args.log:
        pathlib.Path(args.log).write_text("".join(f"{t:8.2f} {line}\n" for t, line in out["lines"]))
    # Goodput only for a run that finished: a failed run's wall time is not a rate.
    ok = res["exit"] == 0 and base["wall_s"]
    res["goodput"] = base["wall_s"] / res["wall_s"] if ok else None
    res["baseline"] = {k: base.get(k) for k in ("wall_s", "accuracy", "hashes", "exit")}
    res["accuracy_delta_points"] = (
        100 * (res["accuracy"] - base["accuracy"])
        if res["accuracy"] is not None and base["accuracy"] is not None
        else None
    )
    res["command"] = " ".join(["python", "benchmarks/chaos.py", *(argv or sys.argv[1:])])
    res["log"] = [line for _, line in out["lines"] if line.startswith(("elastic.py", "chaos.py"))]
    if res["exit"] != 0:
        res["log_tail"] = [line for _, line in out["lines"][-60:]]
        print("\n".join(res["log_tail"]), flush=True)
    _table(args, res)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["exit"] == 0 else 1


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _table(args, res: dict) -> None:
    print()
    print("| # | event | process | at step | restart at | recovered | recovery (s) | rejoin (s) |")
    print("|---:|---|---:|---:|---:|---|---:|---:|")
    for i, e in enumerate(res["events"]):
        print(
            f"| {i} | {e['kind']} | {_fmt(e['process'], 'd')} | {_fmt(e.get('injected_at'), 'd')} "
            f"| {_fmt(e.get('restarted_at'), 'd')} | {e['recovered']} "
            f"| {_fmt(e.get('recovery_s'))} | {_fmt(e.get('rejoin_s'))} |"
        )
    b = res["baseline"]
    print()
    print(
        "| steps | events | exit | wall (s) | undisturbed wall (s) | goodput | steps lost "
        "| steps re-run | gloo aborts | one model (finishers) | accuracy | undisturbed |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    acc = None if res["accuracy"] is None else 100 * res["accuracy"]
    bacc = None if b["accuracy"] is None else 100 * b["accuracy"]
    print(
        f"| {args.steps} | {len(res['events'])} | {res['exit']} | {res['wall_s']:.1f} "
        f"| {_fmt(b['wall_s'], '.1f')} | {_fmt(res['goodput'])} | {res['steps_lost']} "
        f"| {res['steps_rerun']} | {res['gloo_aborts']} "
        f"| {res['one_model']} ({len(res['hashes'])}) | {_fmt(acc, '.1f')} | {_fmt(bacc, '.1f')} |"
    )
    for p, h in sorted(res["hashes"].items()):
        print(f"process {p}: consensus sha256 {h}")
    if res.get("link_bytes") is not None:
        print(f"bytes over the emulated link ({args.slow_link}): {res['link_bytes']:,}")


if __name__ == "__main__":
    sys.exit(main())
