"""``lsgd_jax.plan`` on ``benchmarks/slow_link.py``'s emulated link: its predictions
against the step times measured there.

Two JAX processes ("nodes") of ``--devices`` CPU devices each, each in its own network
namespace, joined over gloo by one veth pair capped with tc's tbf (slow_link.py's
cluster: every byte between the nodes crosses the capped link). At each ``--rates``
rate both processes run ``lsgd_jax.plan`` on a teacher-student MLP (the link probe and
the compute probe timed), then train the ``--top`` candidates it predicts fastest, and
DDP, for ``--steps`` steps from the same model, each phase compiled first; the run goes
once untimed (the first calls of a phase dispatch more than a step) and once more from
the same start, timing each step (it waits for the loss): the measured mean counts every
step of the run, as the predicted one does. Reported per rate: the probe's seconds and fitted link,
and per candidate the predicted and measured average step, and the time to the target
loss (DDP's final training loss) from the measured step times.

A link given as ``RATE@RTT`` (e.g. ``20mbit@50ms``) also has that round trip: this kernel
has no netem, so the namespaces are then joined through ``delay_link.py``'s relay (two
TUN devices, half the round trip each way) instead of the veth; a bare rate is the veth's
own round trip (tens of microseconds). The relay is Python: keep such links at or below
1 Gbit/s.

Run as root::

    PYTHONPATH=. python benchmarks/plan_link.py --rates 10gbit,1gbit@1ms,100mbit@10ms,20mbit@50ms
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import delay_link  # noqa: E402  (a link with a round trip, through a relay)
import slow_link as sl  # noqa: E402  (the emulated cluster: namespaces, veth, tbf)

PREFIX = "lsgdpl"


def worker(args) -> None:
    """One node: plans, then trains the top candidates and DDP; writes JSON."""
    sl.join_cluster(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lsgd_jax
    from lsgd_jax.planner import CANDIDATES

    mesh = lsgd_jax.make_mesh()  # one row ("node") per process
    rows = NamedSharding(mesh, P(lsgd_jax.data_axes(mesh)))
    dims = [int(d) for d in args.dims.split(",")]

    def mlp(seed):
        k = jax.random.split(jax.random.key(seed), len(dims) - 1)
        return [jax.random.normal(k[i], (a, b)) / np.sqrt(a) for i, (a, b) in
                enumerate(zip(dims, dims[1:]))]  # fmt: skip

    def forward(params, x):
        for w in params[:-1]:
            x = jnp.tanh(x @ w)
        return x @ params[-1]

    teacher = mlp(1)
    global_batch = args.batch_per_device * jax.device_count()

    def batch(s):
        local = np.random.default_rng(1000 * s + jax.process_index()).standard_normal(
            (global_batch // jax.process_count(), dims[0]), np.float32
        )
        x = jax.make_array_from_process_local_data(rows, local)
        return {"x": x, "y": forward(teacher, x)}

    def loss_fn(params, b):
        return jnp.mean((forward(params, b["x"]) - b["y"]) ** 2)

    params, optimizer = mlp(0), optax.adam(args.lr)
    say = (lambda msg: print(sl.MARK + msg, flush=True)) if jax.process_index() == 0 else print
    start = time.perf_counter()
    found = lsgd_jax.plan(
        loss_fn, params, batch(0), mesh, optimizer, num_steps=args.steps, tolerance=1.0
    )  # the link, the compute, each kind of step measured
    plan_s, compute, link_s = time.perf_counter() - start, found.compute_s, found.probe_s
    link, flat, probe = found.link, found.flat_link, found.probe
    say(f"links {link_s:.1f} s: {link.bytes_per_s * 8 / 1e6:,.1f} Mbit/s, "
        f"{link.latency_s * 1e3:.3f} ms; flat {flat.bytes_per_s * 8 / 1e6:,.1f} Mbit/s, "
        f"{flat.latency_s * 1e3:.3f} ms; compute {compute * 1e3:.1f} ms; "
        f"the whole plan {plan_s:.1f} s")  # fmt: skip
    say("\n" + str(found))
    by_name = {c.name: c for c in CANDIDATES}
    picks = {t: found.choose(t).name for t in (0.01, 0.05)}  # what a user would be given
    chosen = list(dict.fromkeys([r.name for r in found.rows[: args.top]] + ["DDP"]))
    chosen += [name for name in picks.values() if name not in chosen]
    measured = []
    for name in chosen:
        tx = by_name[name].make(optimizer, args.steps)
        # compile_ahead=0: nothing compiles in the background while steps are timed (DDP's
        # last calls would compile the local phase after its run, into the timed pass)
        step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, compile_ahead=0)
        p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
        step.compile(p, s, batch(0), num_steps=args.steps)
        # the first calls of each phase dispatch more than a step: the run goes once
        # untimed, then again from the same start, timed (every step of it counts)
        # (a run of one phase whose steps are slow, DDP on a WAN, warms up in 3 steps)
        predicted = next(r for r in found.rows if r.name == name)
        warm = args.steps if predicted.step_s * args.steps < 30 else 3
        for num_steps in (warm, args.steps):
            p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
            times, losses = [], []
            for i in range(num_steps):
                b = jax.block_until_ready(batch(i))  # the teacher's forward is not the step's
                t = time.perf_counter()
                p, s, loss = step(p, s, b)
                jax.block_until_ready((p, s, loss))  # all of the step: its update and averages
                times.append(time.perf_counter() - t)
                losses.append(float(loss))
        measured.append({"name": name, "step_s": times, "loss": losses,
                         "predicted_step_s": predicted.step_s, "risk": predicted.risk,
                         "link_bytes": predicted.link_bytes})  # fmt: skip
        say(f"{name}: predicted {predicted.step_s * 1e3:.1f} ms, measured "
            f"{np.mean(times) * 1e3:.1f} ms")  # fmt: skip
    out = {"link": [link.bytes_per_s, link.latency_s], "probe": probe, "link_s": link_s,
           "flat_link": [flat.bytes_per_s, flat.latency_s],  # probe: node axis, then flat
           "picks": picks, "top": [r.name for r in found.rows[: args.top]],
           "plan_s": plan_s, "compute_s": compute, "chosen": found.chosen.name,
           "timed_calls": found.timed_calls, "timing_s": found.timing_s,
           "call_overhead_s": found.call_overhead_s, "runs": measured}  # fmt: skip
    pathlib.Path(args.out, f"worker{args.process_id}.json").write_text(json.dumps(out))


def summarize(rate: str, w: dict) -> list[str]:
    """Markdown rows for one link from process 0's record. The target is the highest of
    the runs' final losses (each run's mean of its last 5 steps), so every run reaches
    it; a run's time to it is its measured time until its 5-step mean first gets there."""

    def mean5(losses: list[float]) -> list[float]:
        return [sum(losses[max(0, i - 4) : i + 1]) / len(losses[max(0, i - 4) : i + 1])
                for i in range(len(losses))]  # fmt: skip

    runs = w["runs"]
    target = max(mean5(r["loss"])[-1] for r in runs)
    flat = w.get("flat_link", [float("nan")] * 2)
    lines = [
        f"**{rate}**: link probes {w['link_s']:.1f} s (the whole plan, candidates compiled: "
        f"{w.get('plan_s', w.get('probe_s', float('nan'))):.1f} s), fitted "
        f"{w['link'][0] * 8 / 1e6:,.1f} Mbit/s and {w['link'][1] * 1e3:.3f} ms a collective "
        f"over the node axis, {flat[0] * 8 / 1e6:,.1f} Mbit/s and {flat[1] * 1e3:.3f} ms for "
        f"one flat all-reduce; compute {w['compute_s'] * 1e3:.1f} ms a step"
        + (
            f"; {w['timed_calls']} timed calls of each kind, {w['timing_s']:.0f} s, a call "
            f"{w['call_overhead_s'] * 1e3:.2f} ms over its program"
            if "timed_calls" in w
            else ""
        )
        + f". Target loss {target:.4f}.",
        "",
        "| setup | predicted step (ms) | measured: mean, median (ms) | error of the mean "
        "| time to target (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    hits = {}
    for r in runs:
        steps = r["step_s"]  # the timed second pass: every phase warm, every step counted
        m, med = sum(steps) / len(steps), sorted(steps)[len(steps) // 2]
        cum, hit = 0.0, None
        for t, loss in zip(steps, mean5(r["loss"])):
            cum += t
            if loss <= target:
                hit = cum
                break
        hits[r["name"]] = hit
        err = r["predicted_step_s"] / m - 1
        tags = [f"top {w['top'].index(r['name']) + 1}"] if r["name"] in w.get("top", []) else []
        tags += [f"pick at {t}" for t, name in w.get("picks", {}).items() if name == r["name"]]
        name = r["name"] + (f" ({', '.join(tags)})" if tags else "")
        lines.append(
            f"| {name} | {r['predicted_step_s'] * 1e3:.1f} | {m * 1e3:.1f}, {med * 1e3:.1f} "
            f"| {err:+.0%} | {hit:.2f} |"
        )
    fastest = min(hits.values())
    for t, name in w.get("picks", {}).items():
        lines.append(f"\nThe pick at tolerance {t}, {name}: {hits[name] / fastest:.2f}x the "
                     "fastest measured time to the target.")  # fmt: skip
    return lines


def round_trip_ms(text: str) -> float:
    """``"50ms"`` or ``"50"`` in milliseconds."""
    value = float(text.removesuffix("ms"))
    if not value >= 0:
        raise ValueError(f"a round trip is >= 0 ms, got {text!r}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rates",
        default="10gbit,1gbit@1ms,100mbit@10ms,20mbit@50ms",
        help="links: a tc rate, or RATE@RTT for a round trip (e.g. 20mbit@50ms)",
    )
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--dims", default="256,512,256,1", help="the MLP's widths")
    ap.add_argument("--batch-per-device", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--devices", type=int, default=4, help="CPU devices per process (node)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per rate")
    ap.add_argument("--json", default=None, help="also write the results here")
    sl.worker_arguments(ap, PREFIX)
    return ap.parse_args(argv)


def at_link(link: str, script: pathlib.Path, args, wargs: list[str]) -> list[dict] | None:
    """Both workers of ``script`` (with ``wargs``) on the emulated ``link`` (``RATE`` or
    ``RATE@RTT``); their JSON records, or None (the reason printed) if it could not run."""
    rate, _, rtt = link.partition("@")
    relay = None
    with sl.signals_raise():
        try:
            sl.safe_teardown(args.prefix)
            if rtt:
                relay = delay_link.setup(args.prefix, delay_ms=round_trip_ms(rtt) / 2)
            else:
                sl.setup(args.prefix)
            # a burst of 2 ms at the rate (at least 32 KB): slow_link's 256 KB would let
            # a small average after a few idle steps cross at the veth's own speed
            burst = max(32_000, int(sl.parse_rate(rate) / 8 * 0.002))
            sl.set_rate(rate, args.prefix, burst=f"{burst}b")
            with tempfile.TemporaryDirectory() as tmp:
                wargs = ["--worker", "--parent", str(os.getpid()), "--out", tmp,
                         "--prefix", args.prefix, *wargs]  # fmt: skip
                out = pathlib.Path(tmp)
                return sl.run_nodes(script, wargs, args, out, f"[{link}] ", f"at {link}: ")
        except (sl.CannotRun, RuntimeError) as e:
            print(f"{script.name}: {e}", file=sys.stderr)
            return None
        finally:
            delay_link.stop(relay)
            sl.safe_teardown(args.prefix)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if not sl.can_run("plan_link.py"):
        return 2
    command = sl.command_line("plan_link.py", argv)
    results, lines = {}, [f"Command: `{command}`", ""]
    for link in args.rates.split(","):
        wargs = ["--steps", str(args.steps), "--top", str(args.top), "--dims", args.dims,
                 "--batch-per-device", str(args.batch_per_device), "--lr", str(args.lr),
                 "--devices", str(args.devices)]  # fmt: skip
        workers = at_link(link, pathlib.Path(__file__), args, wargs)
        if workers is None:
            return 1
        results[link] = workers[0]
        lines += summarize(link, workers[0]) + [""]
        print("\n".join(summarize(link, workers[0])), flush=True)
    print("\n" + "\n".join(lines))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"command": command, "rates": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
