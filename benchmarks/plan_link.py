"""``lsgd_jax.plan`` on ``benchmarks/slow_link.py``'s emulated link: its predictions
against the step times measured there.

Two JAX processes ("nodes") of ``--devices`` CPU devices each, each in its own network
namespace, joined over gloo by one veth pair capped with tc's tbf (slow_link.py's
cluster: every byte between the nodes crosses the capped link). At each ``--rates``
rate both processes run ``lsgd_jax.plan`` on a teacher-student MLP (the link probe and
the compute probe timed), then train the ``--top`` candidates it predicts fastest, and
DDP, for ``--steps`` steps from the same model, each phase compiled first, timing each
step (it waits for the loss). Reported per rate: the probe's seconds and fitted link,
and per candidate the predicted and measured average step, and the time to the target
loss (DDP's final training loss) from the measured step times.

This kernel has no netem, so the link's latency is the veth's own (tens of
microseconds): the rates are emulated, the 50 ms of a WAN is not.

Run as root::

    PYTHONPATH=. python benchmarks/plan_link.py --rates 10gbit,1gbit,100mbit,20mbit
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
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
    link, probe = lsgd_jax.planner.measure_link(mesh)
    link_s = time.perf_counter() - start
    compute = lsgd_jax.planner.measure_compute(loss_fn, params, batch(0), mesh, optimizer)
    probe_s = time.perf_counter() - start
    say(f"probe {probe_s:.1f} s: {link.bytes_per_s * 8 / 1e6:,.1f} Mbit/s, "
        f"{link.latency_s * 1e3:.3f} ms; compute {compute * 1e3:.1f} ms")  # fmt: skip
    found = lsgd_jax.plan(loss_fn, params, batch(0), mesh, optimizer, num_steps=args.steps,
                          tolerance=1.0, link=link, compute_s=compute)  # fmt: skip
    say("\n" + str(found))
    by_name = {c.name: c for c in CANDIDATES}
    chosen = [r.name for r in found.rows[: args.top]]
    if "DDP" not in chosen:
        chosen.append("DDP")
    measured = []
    for name in chosen:
        tx = by_name[name].make(optimizer, args.steps)
        step = lsgd_jax.data_parallel_step(loss_fn, tx, mesh)
        p, s = lsgd_jax.replicate(params, mesh), lsgd_jax.replicate(tx.init(params), mesh)
        step.compile(p, s, batch(0), num_steps=args.steps)
        times, losses = [], []
        for i in range(args.steps):
            b = jax.block_until_ready(batch(i))  # the teacher's forward is not the step's
            t = time.perf_counter()
            p, s, loss = step(p, s, b)
            losses.append(float(loss))
            times.append(time.perf_counter() - t)
        predicted = next(r for r in found.rows if r.name == name)
        measured.append({"name": name, "step_s": times, "loss": losses,
                         "predicted_step_s": predicted.step_s, "risk": predicted.risk,
                         "link_bytes": predicted.link_bytes})  # fmt: skip
        say(f"{name}: predicted {predicted.step_s * 1e3:.1f} ms, measured "
            f"{np.mean(times[1:]) * 1e3:.1f} ms")  # fmt: skip
    out = {"link": [link.bytes_per_s, link.latency_s], "probe": probe, "link_s": link_s,
           "probe_s": probe_s, "compute_s": compute, "chosen": found.chosen.name,
           "runs": measured}  # fmt: skip
    pathlib.Path(args.out, f"worker{args.process_id}.json").write_text(json.dumps(out))


def summarize(rate: str, w: dict) -> list[str]:
    """Markdown rows for one rate from process 0's record."""
    runs = w["runs"]
    ddp = next(r for r in runs if r["name"] == "DDP")
    target = ddp["loss"][-1]
    lines = [
        f"**{rate}**: probe {w['probe_s']:.1f} s (link {w['link_s']:.1f} s), fitted "
        f"{w['link'][0] * 8 / 1e6:,.1f} Mbit/s and {w['link'][1] * 1e3:.3f} ms a collective; "
        f"compute {w['compute_s'] * 1e3:.1f} ms a step. Target: DDP's final training loss.",
        "",
        "| setup | predicted step (ms) | measured: mean, median (ms) | error of the mean "
        "| time to target (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        steady = r["step_s"][2:]  # the first calls of a phase dispatch more than a step
        m, med = sum(steady) / len(steady), sorted(steady)[len(steady) // 2]
        cum, hit = 0.0, None
        for t, loss in zip(r["step_s"], r["loss"]):
            cum += t
            if loss <= target:
                hit = cum
                break
        err = r["predicted_step_s"] / m - 1
        lines.append(
            f"| {r['name']} | {r['predicted_step_s'] * 1e3:.1f} | {m * 1e3:.1f}, {med * 1e3:.1f} "
            f"| {err:+.0%} "
            f"| {f'{hit:.1f}' if hit is not None else 'not reached'} |"
        )
    return lines


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="10gbit,1gbit,100mbit,20mbit")
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    missing = sl.requirements()
    if missing:
        print("plan_link.py cannot run here; it needs:\n" + "\n".join(missing), file=sys.stderr)
        return 2
    command = "PYTHONPATH=. python benchmarks/plan_link.py " + shlex.join(argv)
    results, lines = {}, [f"Command: `{command}`", ""]
    for rate in args.rates.split(","):
        with sl.signals_raise():
            try:
                sl.safe_teardown(args.prefix)
                sl.setup(args.prefix)
                sl.set_rate(rate, args.prefix)
                with tempfile.TemporaryDirectory() as tmp:
                    wargs = ["--worker", "--parent", str(os.getpid()), "--out", tmp,
                             "--prefix", args.prefix, "--steps", str(args.steps),
                             "--top", str(args.top), "--dims", args.dims,
                             "--batch-per-device", str(args.batch_per_device),
                             "--lr", str(args.lr), "--devices", str(args.devices)]  # fmt: skip
                    here, out = pathlib.Path(__file__), pathlib.Path(tmp)
                    workers = sl.run_nodes(here, wargs, args, out, f"[{rate}] ", f"at {rate}: ")
            except (sl.CannotRun, RuntimeError) as e:
                print(f"plan_link.py: {e}", file=sys.stderr)
                return 1
            finally:
                sl.safe_teardown(args.prefix)
        results[rate] = workers[0]
        lines += summarize(rate, workers[0]) + [""]
        print("\n".join(summarize(rate, workers[0])), flush=True)
    print("\n" + "\n".join(lines))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"command": command, "rates": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
