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
    python benchmarks/lm_sweep.py frontier --plot docs/lm_frontier.png

A plan name is ``MODEL-SETUP-lr`` (a learning-rate sweep on seed 0) or
``MODEL-SETUP-seeds:LR`` (seeds 0, 1, 2 at that rate); MODEL is one of :data:`MODELS`,
SETUP one of :data:`SETUPS`. Extra flags for every run of the plan follow ``--``, and
``--tag`` names that variant (``... run --plan lm-recipe-lr --tag om09 -- --outer-momentum
0.9``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
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


# What each tag of a run name means (docs/lm.md's frontier); a run without a tag is its
# setup as SETUPS gives it.
TAGS: dict[str, str] = {
    "": "",
    "q4ddp": "4-bit two-level DDP throughout",
    "h16": "recipe, H=16",
    "s200": "recipe, switch at 200",
    "s300": "recipe, switch at 300 (a fifth)",
    "s500": "recipe, switch at 500 (a third)",
    "s200h16": "recipe, switch at 200, H=16",
    "om09": "recipe, outer momentum 0.9",
    "d8": "recipe, H=8",
    "d4": "recipe, H=4",
    "l8": "plain 8-bit averages, H=8",
    "l16": "plain 8-bit averages, H=16",
    "l32": "plain 8-bit averages, H=32",
}
NAME = re.compile(r"^(?P<model>[a-z]+)_(?P<setup>[a-z]+)(?:_(?P<tag>[a-z0-9]+))?"
                  r"_lr(?P<lr>[0-9]+e-[0-9]+)_seed(?P<seed>[0-9]+)$")  # fmt: skip


def records(out: pathlib.Path) -> dict[tuple[str, str, str, float], dict[int, dict]]:
    """The finished runs in ``out``: ``{(model, setup, tag, lr): {seed: numbers}}``."""
    found: dict[tuple[str, str, str, float], dict[int, dict]] = {}
    for path in sorted(out.glob("*.json")):
        m = NAME.match(path.stem)
        r = load(out, path.stem) if m else None
        if m and r is not None and r["done"]:
            key = (m["model"], m["setup"], m["tag"] or "", float(m["lr"]))
            found.setdefault(key, {})[int(m["seed"])] = r
    return found


def frontier(out: pathlib.Path) -> list[dict]:
    """Each setup at its best inner learning rate (by seed 0), against the tuned DDP.

    DDP's best rate is the one with the lowest seed-0 loss among its untagged runs. A
    setup's gap on a seed is its loss less DDP's (tuned) on the same seed, for the seeds
    both have; ``ratio`` is DDP's node-link bytes over the setup's.

    Returns:
      One dict a setup (model, setup, tag, label, lr, seeds, gaps, mean, lo, hi, mb,
      ratio), DDP's own first in each model, sorted by model then bytes.
    """
    found = records(out)
    rows = []
    for model in sorted({k[0] for k in found}):
        ddp = {k: v for k, v in found.items() if k[0] == model and k[1:3] == ("ddp", "")}
        if not any(0 in v for v in ddp.values()):
            continue
        best_ddp = min((k for k in ddp if 0 in ddp[k]), key=lambda k: ddp[k][0]["val_loss"])
        reference = ddp[best_ddp]
        setups: dict[tuple[str, str], list] = {}
        for key in found:
            if key[0] == model and 0 in found[key]:
                setups.setdefault(key[1:3], []).append(key)
        for (setup, tag), keys in setups.items():
            best = min(keys, key=lambda k: found[k][0]["val_loss"])
            runs = found[best]
            seeds = sorted(s for s in runs if s in reference)
            gaps = [runs[s]["val_loss"] - reference[s]["val_loss"] for s in seeds]
            mb = runs[0]["node_link_bytes"] / 1e6
            rows.append({
                "model": model, "setup": setup, "tag": tag, "lr": best[3], "seeds": seeds,
                "label": TAGS.get(tag, tag) or {"ddp": "DDP", "recipe": "slow-link recipe"}.get(
                    setup, setup),
                "loss": sum(runs[s]["val_loss"] for s in seeds) / max(len(seeds), 1),
                "gaps": gaps, "mean": sum(gaps) / max(len(gaps), 1),
                "lo": min(gaps, default=0.0), "hi": max(gaps, default=0.0), "mb": mb,
                "ratio": reference[0]["node_link_bytes"] / max(runs[0]["node_link_bytes"], 1),
            })  # fmt: skip
    rows.sort(key=lambda r: (r["model"], r["setup"] != "ddp", -r["mb"]))
    return rows


def frontier_table(rows: list[dict]) -> str:
    """The frontier as a markdown table."""
    out = [
        "| model | setup | inner lr | seeds | loss (mean) | gap to tuned DDP: mean [range]"
        " | node-link MB | DDP's bytes / its |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap = f"{r['mean']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}]"
        out.append(
            f"| {r['model']} | {r['label']} | {r['lr']:g} | {len(r['seeds'])} | {r['loss']:.4f}"
            f" | {gap} | {r['mb']:,.1f} | {r['ratio']:.1f} |"
        )
    return "\n".join(out)


def best_within(rows: list[dict], model: str, tolerance: float, seeds: int = 3) -> dict | None:
    """The setup with the highest bytes ratio whose every seed (``seeds`` of them) ends
    within ``tolerance`` of the tuned DDP on the same seed; None if there is none."""
    ok = [r for r in rows if r["model"] == model and len(r["seeds"]) >= seeds
          and r["hi"] <= tolerance and r["setup"] != "ddp"]  # fmt: skip
    return max(ok, key=lambda r: r["ratio"], default=None)


# The planner's candidates (lsgd_jax.planner.CANDIDATES) and the runs that measured each:
# (setup, tag), at the setup's best inner rate on each model.
CANDIDATE_RUNS: dict[str, tuple[str, str]] = {
    "DDP": ("ddp", ""),
    "DDP, 4-bit two-level gradient means": ("recipe", "q4ddp"),
    "DiLoCo H=32, 8-bit averages, 4-bit warm-up to 1/3": ("recipe", "s500"),
    "DiLoCo H=32, 8-bit averages, 4-bit warm-up to 1/5": ("recipe", "s300"),
    "plain 8-bit averages H=8, 4-bit warm-up to 1/15": ("recipe", "l8"),
    "DiLoCo H=16, 8-bit averages, 4-bit warm-up to 1/15": ("recipe", "h16"),
    "slow-link recipe: DiLoCo H=32, 8-bit, 4-bit warm-up to 1/15": ("recipe", ""),
}


def run_name(row: dict, seed: int) -> str:
    """The run name of a frontier row's setup on ``seed``."""
    tag = f"_{row['tag']}" if row["tag"] else ""
    return f"{row['model']}_{row['setup']}{tag}_lr{lr_label(row['lr'])}_seed{seed}"


def seed_curves(out: pathlib.Path) -> dict[str, dict[tuple[str, int], list[float]]]:
    """``{candidate: {(model, seed): gaps}}``: at each evaluation of the run but the first
    (steps 100, 200, ..., 1500), the candidate's validation loss less the tuned DDP's
    final loss on the same seed (each setup at its best inner rate)."""
    rows = frontier(out)
    ddp = {r["model"]: r for r in rows if (r["setup"], r["tag"]) == ("ddp", "")}
    curves: dict[str, dict[tuple[str, int], list[float]]] = {}
    for name, (setup, tag) in CANDIDATE_RUNS.items():
        for r in (r for r in rows if (r["setup"], r["tag"]) == (setup, tag)):
            for seed in r["seeds"]:
                final = json.loads((out / f"{run_name(ddp[r['model']], seed)}.json").read_text())
                losses = json.loads((out / f"{run_name(r, seed)}.json").read_text())
                evals = losses[0]["history"]["val_loss"][1:]
                gaps = [v - final[0]["val_loss"] for v in evals]
                curves.setdefault(name, {})[(r["model"], seed)] = gaps
    return curves


def reach_curves(out: pathlib.Path) -> dict[str, tuple[float, ...]]:
    """Each candidate's quality curve for ``lsgd_jax.planner``: :func:`seed_curves`' worst
    over models and seeds at each point, rounded up to 1e-4 (the last point is the
    candidate's risk)."""
    return {
        name: tuple(math.ceil(max(g) * 1e4 - 1e-6) / 1e4 for g in zip(*runs.values()))
        for name, runs in seed_curves(out).items()
    }


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """The frontier as a picture: per model, the gap to the tuned DDP (mean, and the
    range over seeds) against DDP's bytes over the setup's; one seed is a hollow mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    top = 0.08  # a setup further behind is drawn on the top edge, its gap in its label
    for ax, model in zip(axes[0], models):
        shown = [r for r in rows if r["model"] == model and r["setup"] != "ddp"]
        for i, r in enumerate(sorted(shown, key=lambda r: r["ratio"])):
            face = "C0" if len(r["seeds"]) >= 3 else "none"
            label = f"{r['label']} ({r['mean']:+.3f})"
            if r["mean"] > top:
                ax.plot(r["ratio"], top, "^", color="C1", mfc="none", clip_on=False)
            else:
                err = [[r["mean"] - r["lo"]], [r["hi"] - r["mean"]]]
                ax.errorbar(r["ratio"], r["mean"], yerr=err, fmt="o", color="C0", mfc=face,
                            capsize=3)  # fmt: skip
            y = min(r["mean"], top)
            ax.annotate(label, (r["ratio"], y), textcoords="offset points",
                        xytext=(5, 4 if i % 2 and y < top else -10), fontsize=7)  # fmt: skip
        for tol, style in ((0.01, ":"), (0.02, "--"), (0.05, "-.")):
            ax.axhline(tol, color="grey", ls=style, lw=0.8, label=f"+{tol}")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks([5, 10, 20, 50, 100, 200], ["5x", "10x", "20x", "50x", "100x", "200x"])
        ax.set_xlim(8, 160)
        ax.set_ylim(min(-0.02, *(r["lo"] - 0.005 for r in shown)), top)
        ax.set_xlabel("DDP's node-link bytes / the setup's (whole run)")
        ax.set_ylabel("final val loss - tuned DDP's (nats per byte)")
        ax.set_title(f"{model}: each setup at its best inner rate (filled: 3 seeds)")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["run", "table", "list", "frontier", "curves"])
    p.add_argument("--plan", action="append", default=[], help="e.g. lm-ddp-lr (repeatable)")
    p.add_argument("--tag", default="", help="names a variant (its extra flags follow --)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--lrs", default="", help="learning rates of an -lr plan, e.g. 4e-3,8e-3")
    p.add_argument("--out", default=str(OUT), help="the folder of the records")
    p.add_argument("--plot", default="", help="frontier: also draw it to this PNG")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out)
    if a.action == "curves":
        for name, curve in reach_curves(out).items():
            print(f"{name!r}: {curve},")
        return
    if a.action == "frontier":
        rows = frontier(out)
        print(frontier_table(rows))
        for model in sorted({r["model"] for r in rows}):
            for tol in (0.01, 0.02, 0.05):
                r = best_within(rows, model, tol)
                print(f"{model}: within {tol} on 3 seeds: "
                      + (f"{r['label']} at 1/{r['ratio']:.1f}" if r else "none"))  # fmt: skip
        if a.plot:
            plot(rows, pathlib.Path(a.plot))
        return
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
