"""``lsgd_jax.plan`` for the language model of issue 34 on the emulated links: its pick
against the candidate measured fastest to the target loss.

The done-when of issue 36 at the scale of the language models: a 1,500-step run of
``examples/lm.py``'s model (``--model lm``, or ``deep``) whose every candidate was trained
to the end, three seeds, in benchmarks/results/issue34 (no link: the math of a step does
not depend on the link, only its time does). Here, on each link of ``--rates`` (as
``plan_link.py``: two JAX processes, one a node, in network namespaces joined by a
tbf-capped veth, or through ``delay_link.py``'s relay for ``RATE@RTT``), both processes

1. run ``lsgd_jax.plan`` on the model, its optimizer (AdamW, warm-up and cosine decay
   over the 1,500 steps, at the tuned rate) and a batch, the probes timed;
2. time every candidate's steps on that link: a candidate of one kind of step (DDP)
   for ``--one-phase-steps`` steps, the others as built for ``--measure-steps`` steps
   (the same programs, each kind of step several times over: warm-up, local steps,
   averages), once untimed and once timed; each kind's median step;
3. compose each candidate's 1,500-step run from those medians, step by step as its
   chain for 1,500 steps runs them (``DataParallelStep.plan_of``).

A candidate's measured time to a target (a tuned DDP's final loss on the same seed plus
a tolerance) is its composed run's time until its own validation curve of that seed
(issue 34's records) first reaches the target, linear between evaluations; the pick at
each tolerance is ``Plan.choose``'s. Run as root::

    PYTHONPATH=. python benchmarks/plan_lm_link.py \\
        --rates 10gbit,1gbit@1ms,100mbit@10ms,20mbit@50ms \\
        --json benchmarks/results/issue36/plan_lm_link.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lm_sweep  # noqa: E402  (issue 34's records and the candidates' runs)
import plan_link  # noqa: E402  (the emulated links)
import slow_link as sl  # noqa: E402

PREFIX = "lsgdpm"
TOLERANCES = (0.01, 0.02, 0.05)
WARMUP = 50  # examples/lm.py's --warmup in issue 34's runs
TUNED_LR = {"lm": 6e-3, "deep": 1e-2}


def worker(args) -> None:
    """One node: plans, then times every candidate's kinds of step; writes JSON."""
    sl.join_cluster(args)
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lsgd_jax
    from lsgd_jax.planner import CANDIDATES

    lm = lm_link_module()
    me = jax.process_index()
    mesh = lsgd_jax.make_mesh()
    rows = NamedSharding(mesh, P(lsgd_jax.data_axes(mesh)))
    flags = lm.parse_args([*lm_sweep.MODELS[args.model], "--steps", str(args.steps)])
    cfg = lm.ModelConfig(flags.layers, flags.width, flags.heads, flags.context)
    graphdef, params = lm.init_model(cfg, 0)
    loss_fn = lm.make_loss_fn(graphdef)
    schedule = optax.warmup_cosine_decay_schedule(0.0, TUNED_LR[args.model], WARMUP, args.steps)
    optimizer = optax.adamw(schedule, b2=0.99, weight_decay=0.1)
    data = lm.batches(lm.load_corpus(4.0).train, flags.global_batch, cfg.context, 0)
    half = flags.global_batch // 2
    local = [next(data)["tokens"][me * half : (me + 1) * half] for _ in range(args.measure_steps)]

    def batch(i):
        return {"tokens": jax.make_array_from_process_local_data(rows, local[i])}

    say = (lambda msg: print(sl.MARK + msg, flush=True)) if me == 0 else print
    start = time.perf_counter()
    found = lsgd_jax.plan(
        loss_fn, params, batch(0), mesh, optimizer, num_steps=args.steps, tolerance=1.0
    )  # the link, the compute, each kind of step measured
    plan_s, link_s = time.perf_counter() - start, found.probe_s
    link, flat, probe = found.link, found.flat_link, found.probe
    say(f"links {link_s:.1f} s, the whole plan {plan_s:.1f} s\n{found}")
    runs = []
    for c in CANDIDATES:
        runs.append(time_candidate(c, args, loss_fn, params, optimizer, mesh, batch))
        row = next(r for r in found.rows if r.name == c.name)
        runs[-1].update(predicted_step_s=row.step_s, predicted_elapsed_s=row.elapsed_s,
                        predicted_phase_s=row.phase_step_s, timed_phases=row.timed_phases,
                        phase_compute_s=row.phase_compute_s)  # fmt: skip
        mean = runs[-1]["mean_s"]
        say(f"{c.name}: predicted {row.step_s * 1e3:.1f} ms, measured {mean * 1e3:.1f} ms "
            f"a step (medians {runs[-1]['median_s']})")  # fmt: skip
    out = {"link": [link.bytes_per_s, link.latency_s], "flat_link": [flat.bytes_per_s,
           flat.latency_s], "probe": probe, "link_s": link_s, "plan_s": plan_s,
           "compute_s": found.compute_s, "picks": {t: found.choose(t).name for t in TOLERANCES},
           "timed_calls": found.timed_calls, "timing_s": found.timing_s,
           "call_overhead_s": found.call_overhead_s, "runs": runs}  # fmt: skip
    pathlib.Path(args.out, f"worker{args.process_id}.json").write_text(json.dumps(out))


def time_candidate(c, args, loss_fn, params, optimizer, mesh, batch) -> dict:
    """A candidate's kinds of step timed on the link, and its 1,500-step run composed."""
    import jax

    import lsgd_jax

    def built(num_steps):
        tx = c.make(optimizer, num_steps)
        # compile_ahead=0: no phase past the timed steps compiles in the background (a
        # run built for 20 steps of DDP would compile its local phase during the timing)
        step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, compile_ahead=0)
        p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
        return tx, step, p, s

    _, full, p, s = built(args.steps)
    kinds = full.plan_of(p, s, batch(0), num_steps=args.steps)
    n = args.one_phase_steps if len(set(kinds)) == 1 else args.measure_steps
    tx, step, p, s = built(n)
    measured_kinds = step.plan_of(p, s, batch(0), num_steps=n)
    if not set(kinds) <= set(measured_kinds):
        raise RuntimeError(f"{c.name}: {n} steps do not run every kind of its run's steps")
    step.compile(p, s, batch(0), num_steps=n)
    for _pass in ("untimed", "timed"):
        p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
        times = []
        for i in range(n):
            b = jax.block_until_ready(batch(i))
            t = time.perf_counter()
            p, s, loss = step(p, s, b)
            jax.block_until_ready((p, s, loss))  # all of the step: its update and averages
            times.append(time.perf_counter() - t)
    median = {str(k): statistics.median(t for t, m in zip(times, measured_kinds) if m == k)
              for k in set(measured_kinds)}  # fmt: skip
    run = [median[str(k)] for k in kinds]
    return {"name": c.name, "kinds_measured": [str(k) for k in measured_kinds],
            "step_s": times, "median_s": median, "mean_s": sum(run) / len(run),
            "elapsed_s": [sum(run[:i]) for i in range(len(run) + 1)]}  # fmt: skip


def lm_link_module():
    """examples/lm.py as a module."""
    import lm_link

    return lm_link._lm()


def at(elapsed: list[float], share: float) -> float:
    """The seconds of the run's first ``share`` (linear between steps)."""
    x = share * (len(elapsed) - 1)
    j = min(int(x), len(elapsed) - 2)
    return elapsed[j] + (x - j) * (elapsed[j + 1] - elapsed[j])


def summarize(link: str, w: dict, model: str) -> list[str]:
    """Markdown for one link: each candidate's predicted and measured mean step, and per
    tolerance its predicted time to within it (``Row.to_within``, the plan's curve, the
    worst seed) beside the measured one on each seed (its own curve); then the pick's
    measured time against the fastest candidate's, per tolerance and seed."""
    from lsgd_jax.planner import CANDIDATES, Candidate

    curves = lm_sweep.seed_curves(lm_sweep.OUT)
    by_name = {c.name: c for c in CANDIDATES}
    lines = [
        f"**{link}**: link probes {w['link_s']:.1f} s, the whole plan {w['plan_s']:.1f} s; "
        f"fitted {w['link'][0] * 8 / 1e6:,.1f} Mbit/s, {w['link'][1] * 1e3:.3f} ms over the "
        f"node axis, {w['flat_link'][0] * 8 / 1e6:,.1f} Mbit/s, {w['flat_link'][1] * 1e3:.3f} "
        f"ms flat; compute {w['compute_s'] * 1e3:.1f} ms a step"
        + (
            f"; {w['timed_calls']} timed calls of each kind, {w['timing_s']:.0f} s, a call "
            f"{w['call_overhead_s'] * 1e3:.2f} ms over its program."
            if "timed_calls" in w
            else "."
        ),
        "",
        "| setup | mean step, predicted / measured (ms) | error | "
        + " | ".join(f"to DDP+{t} (s): predicted; measured, seeds 0/1/2" for t in TOLERANCES)
        + " |",
        "|---|---:|---:|" + "---:|" * len(TOLERANCES),
    ]
    predicted = {
        t: {r["name"]: at(r["predicted_elapsed_s"], by_name[r["name"]].reach(t))
            for r in w["runs"] if by_name[r["name"]].reach(t) is not None}
        for t in TOLERANCES
    }  # fmt: skip
    top = sorted(predicted[0.05], key=predicted[0.05].get)[:3]
    hits: dict[tuple[float, int], dict[str, float]] = {}
    for r in w["runs"]:
        cells = []
        for t in TOLERANCES:
            seeds = []
            for seed in (0, 1, 2):
                gaps = curves.get(r["name"], {}).get((model, seed))
                reach = None if gaps is None else Candidate(
                    "seed", lambda o, n: o, gaps[-1], "", tuple(gaps)).reach(t)  # fmt: skip
                if reach is not None:
                    hits.setdefault((t, seed), {})[r["name"]] = at(r["elapsed_s"], reach)
                seeds.append("-" if gaps is None else "never" if reach is None
                             else f"{at(r['elapsed_s'], reach):,.0f}")  # fmt: skip
            guess = predicted[t].get(r["name"])
            cells.append(("never" if guess is None else f"{guess:,.0f}") + "; " + " / ".join(seeds))
        tags = [f"top {top.index(r['name']) + 1} at 0.05"] if r["name"] in top else []
        tags += [f"pick at {t}" for t, name in w["picks"].items() if name == r["name"]]
        name = r["name"] + (f" ({', '.join(tags)})" if tags else "")
        err = r["predicted_step_s"] / r["mean_s"] - 1
        lines.append(f"| {name} | {r['predicted_step_s'] * 1e3:.1f} / {r['mean_s'] * 1e3:.1f} "
                     f"| {err:+.0%} | " + " | ".join(cells) + " |")  # fmt: skip
    for t, pick in w["picks"].items():
        ratios = []

        def always(name: str, t: str = t) -> bool:  # within t on every seed it ran
            seeds = [s for s in (0, 1, 2) if (model, s) in curves.get(name, {})]
            return bool(seeds) and all(name in hits.get((float(t), s), {}) for s in seeds)

        for seed in (0, 1, 2):
            got = hits.get((float(t), seed), {})
            if pick in got:
                best = min(got, key=got.get)
                note = "" if best == pick else f" (fastest: {best})"
                sure = [n for n in got if always(n)]
                if best != pick and not always(best) and sure:
                    near = min(sure, key=got.get)
                    note = (f" (fastest: {best}, not within {t} on every seed; of those that "
                            f"are, {got[pick] / got[near]:.2f}x)")  # fmt: skip
                ratios.append(f"seed {seed} {got[pick] / got[best]:.2f}x{note}")
        lines.append(f"\nThe pick at tolerance {t}, {pick}: " + "; ".join(ratios) + ".")
    return lines


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="10gbit,1gbit@1ms,100mbit@10ms,20mbit@50ms")
    ap.add_argument("--model", default="lm", choices=sorted(TUNED_LR))
    ap.add_argument("--steps", type=int, default=1500, help="the run (issue 34's)")
    ap.add_argument("--measure-steps", type=int, default=96)
    ap.add_argument("--one-phase-steps", type=int, default=20)
    ap.add_argument("--devices", type=int, default=4, help="CPU devices per process (node)")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per rate")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--report", default=None, help="print the tables of this --json record")
    sl.worker_arguments(ap, PREFIX)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if args.report:
        record = json.loads(pathlib.Path(args.report).read_text())
        print(f"Command: `{record['command']}`\n")
        for link, w in record["rates"].items():
            print("\n".join(summarize(link, w, args.model)) + "\n")
        return 0
    if not sl.can_run("plan_lm_link.py"):
        return 2
    command = sl.command_line("plan_lm_link.py", argv)
    results, lines = {}, [f"Command: `{command}`", ""]
    for link in args.rates.split(","):
        wargs = ["--model", args.model, "--steps", str(args.steps), "--measure-steps",
                 str(args.measure_steps), "--one-phase-steps", str(args.one_phase_steps),
                 "--devices", str(args.devices)]  # fmt: skip
        workers = plan_link.at_link(link, pathlib.Path(__file__), args, wargs)
        if workers is None:
            return 1
        results[link] = workers[0]
        if args.json:  # as it goes: a cut run keeps its links
            pathlib.Path(args.json).write_text(json.dumps({"command": command, "rates": results}))
        lines += summarize(link, workers[0], args.model) + [""]
        print("\n".join(summarize(link, workers[0], args.model)), flush=True)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
