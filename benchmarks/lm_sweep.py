"""Learning-rate sweeps and seed repeats of ``examples/lm.py``, resumable, with a table.

The tuning protocol of every quality comparison we publish (docs/lm.md, "How we tune"):
for each method, sweep the inner peak learning rate on seed 0 (at least four values
spanning the best by 2x or more on each side), take the best by final validation loss,
then run seeds 0, 1 and 2 there. Local-SGD setups then tune what they set (outer learning
rate and momentum, period, warm-up) on a small grid at their best inner rate. Every run
has the same steps, batch and data order as the others of its model.

A run is a name and ``examples/lm.py`` flags. ``run`` starts the runs of a plan that have
no record yet (``<out>/<name>.json``), ``--jobs`` at a time, niced, each writing its log,
its evaluations as it goes (``<name>.json.progress.jsonl``) and, at its end, its record;
``<out>/commands.txt`` keeps each run's command line. A sweep cut short resumes where it
stopped: run the same command again. ``table`` prints what is there::

    python benchmarks/lm_sweep.py run --plan lm-ddp-lr --jobs 2
    python benchmarks/lm_sweep.py table --plan lm-ddp-lr
    python benchmarks/lm_sweep.py list            # the plans and their runs

A plan name is ``MODEL-SETUP-lr`` (a learning-rate sweep on seed 0) or
``MODEL-SETUP-seeds:LR`` (seeds 0, 1, 2 at that rate); MODEL is one of :data:`MODELS`,
SETUP one of :data:`SETUPS`. Extra flags for every run of the plan follow ``--``, and
``--tag`` names that variant (``... run --plan lm-recipe-lr --tag om09 -- --outer-momentum
0.9``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "issue34"
LM = ROOT / "examples" / "lm.py"

# The two models (examples/lm.py flags): the default byte-level transformer (2 layers,
# width 128, context 128, 479k params), and a deeper, narrower one with a shorter context
# and a larger batch (6 layers, width 64, context 64, 64 sequences: the same bytes a
# step).
MODELS: dict[str, list[str]] = {
    "lm": [],
    "deep": [*("--layers", "6", "--width", "64", "--heads", "4", "--context", "64")]
    + ["--global-batch", "64"],
}
COMMON = [*("--steps", "1500", "--warmup", "50", "--eval-every", "100", "--no-progress")]
# The setups compared: DDP and the slow-link recipe (examples/lm.py --recipe slow-link);
# more are added as tags of these (extra flags).
SETUPS: dict[str, list[str]] = {
    "ddp": ["--compare", "ddp"],
    "recipe": ["--recipe", "slow-link"],
}
# Learning rates swept on seed 0 (the inner peak of AdamW's warm-up and cosine).
LRS: dict[str, list[float]] = {
    "ddp": [3e-3, 6e-3, 1e-2, 2e-2, 3e-2],
    "recipe": [3e-3, 6e-3, 1e-2, 2e-2],
}
SEEDS = (0, 1, 2)


def lr_label(lr: float) -> str:
    """``0.006`` -> ``"6e-3"``: a learning rate as it appears in run names."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def plan_runs(
    plan: str, tag: str = "", extra: Sequence[str] = (), lrs: Sequence[float] = ()
) -> dict[str, list[str]]:
    """``{run name: lm.py flags}`` of a plan (see the module's docstring); ``lrs``
    replaces the learning rates of an ``-lr`` plan."""
    try:
        model, setup, what = plan.split("-", 2)
        kind, _, value = what.partition(":")
        flags = MODELS[model] + SETUPS[setup]
        if kind == "lr":
            grid = [(lr, 0) for lr in (lrs or LRS[setup])]
        elif kind == "seeds":
            grid = [(float(value), seed) for seed in SEEDS]
        else:
            raise KeyError(kind)
    except (KeyError, ValueError):
        raise SystemExit(
            f"unknown plan {plan!r}: use MODEL-SETUP-lr or MODEL-SETUP-seeds:LR with MODEL"
            f" in {sorted(MODELS)} and SETUP in {sorted(SETUPS)}, e.g. lm-ddp-lr"
        ) from None
    suffix = f"_{tag}" if tag else ""
    return {
        f"{model}_{setup}{suffix}_lr{lr_label(lr)}_seed{seed}": [
            *flags,
            *COMMON,
            *("--lr", repr(lr), "--seed", str(seed)),
            *extra,
        ]
        for lr, seed in grid
    }


def command(name: str, flags: Sequence[str], out: pathlib.Path) -> list[str]:
    """The run's command line (niced; its record goes to ``<out>/<name>.json``)."""
    record = str(out / f"{name}.json")
    return ["nice", "-n", "10", sys.executable, str(LM), *flags, "--json", record]


def run(runs: dict[str, list[str]], out: pathlib.Path, jobs: int) -> None:
    """Starts the runs without a record, ``jobs`` at a time; waits for them all."""
    out.mkdir(parents=True, exist_ok=True)
    todo = [(n, f) for n, f in runs.items() if not (out / f"{n}.json").exists()]
    active: list[tuple[str, subprocess.Popen]] = []
    while todo or active:
        while todo and len(active) < jobs:
            name, flags = todo.pop(0)
            (out / f"{name}.json.progress.jsonl").unlink(missing_ok=True)  # a cut run restarts
            cmd = command(name, flags, out)
            with open(out / "commands.txt", "a") as f:
                f.write(f"{name}: {shlex.join(cmd[3:])}\n")
            log = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed when it ends)
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
            active.append((name, proc))
            print(f"started {name}", flush=True)
        time.sleep(5)
        for name, proc in list(active):
            if proc.poll() is not None:
                active.remove((name, proc))
                state = "done" if proc.returncode == 0 else f"FAILED ({proc.returncode})"
                print(f"{state} {name}", flush=True)


def load(out: pathlib.Path, name: str) -> dict | None:
    """A run's final numbers: its record, or its last evaluation while it runs."""
    path = out / f"{name}.json"
    if path.exists():
        record = json.loads(path.read_text())[0]
        return {"val_loss": record["val_loss"], "step": record["steps"], "done": True,
                "node_link_bytes": record["node_link_bytes"]}  # fmt: skip
    progress = out / f"{name}.json.progress.jsonl"
    if progress.exists() and progress.read_text().strip():
        last = json.loads(progress.read_text().strip().splitlines()[-1])
        return {"val_loss": last["val_loss"], "step": last["step"], "done": False,
                "node_link_bytes": last.get("node_link_bytes", 0)}  # fmt: skip
    return None


def table(runs: dict[str, list[str]], out: pathlib.Path) -> str:
    """A markdown table of the runs: final validation loss (or the step reached)."""
    rows = ["| run | val loss | node-link MB |", "|---|---:|---:|"]
    for name in runs:
        r = load(out, name)
        if r is None:
            rows.append(f"| {name} | - | - |")
            continue
        loss = f"{r['val_loss']:.4f}" + ("" if r["done"] else f" (step {r['step']})")
        rows.append(f"| {name} | {loss} | {r['node_link_bytes'] / 1e6:,.1f} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["run", "table", "list"])
    p.add_argument("--plan", action="append", default=[], help="e.g. lm-ddp-lr (repeatable)")
    p.add_argument("--tag", default="", help="names a variant (its extra flags follow --)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--lrs", default="", help="learning rates of an -lr plan, e.g. 4e-3,8e-3")
    p.add_argument("--out", default=str(OUT), help="the folder of the records")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out)
    lrs = [float(x) for x in a.lrs.split(",")] if a.lrs else []
    if a.action == "list":
        plans = [f"{m}-{s}-lr" for m in MODELS for s in SETUPS]
        for plan in a.plan or plans:
            for name, flags in plan_runs(plan, a.tag, extra, lrs).items():
                print(f"{name}: {shlex.join(flags)}")
        return
    runs = {k: v for plan in a.plan for k, v in plan_runs(plan, a.tag, extra, lrs).items()}
    if not runs:
        p.error("name a plan: --plan lm-ddp-lr (see list)")
    if a.action == "run":
        run(runs, out, a.jobs)
    print(table(runs, out))


if __name__ == "__main__":
    main()
