"""The language model of ``examples/lm.py`` across ``benchmarks/slow_link.py``'s emulated link.

Two JAX processes ("nodes") of ``--devices`` CPU devices each, each in its own network
namespace, joined over gloo by one veth pair whose bandwidth ``tc`` tbf caps (the
cluster of ``slow_link.py``; every byte between the nodes crosses the capped link).
Each process is one row of ``lsgd_jax.make_mesh()`` and feeds its half of every global
batch. For each method (``ddp``, ``localH``, ``dilocoH``, with ``:bitsN`` / ``:delayD``
as in ``examples/lm.py --compare``) it compiles every phase first, then trains
``--steps`` steps from the same initial model, timing each step (it waits for the
loss), and evaluates the consensus model on held-out text every ``--eval-every`` steps
(not timed). The veth's own counters give the bytes each run put on the link.

Reported per method: validation loss (nats per byte), the steps' wall time, link bytes,
and the time to the target loss (DDP's final validation loss unless ``--target``):
the summed step times up to the first evaluation at or below it.

Run as root (network namespaces, veth, tc)::

    PYTHONPATH=. python benchmarks/lm_link.py --rate 100mbit --steps 300 --start 100 \\
        --methods ddp,local32,diloco32 --json /tmp/lm_link.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import slow_link as sl  # noqa: E402  (the emulated cluster: namespaces, veth, tbf)

ROOT = sl.ROOT
PREFIX = "lsgdlm"  # namespaces lsgdlm0/1, veths lsgdlm0v/1v (not slow_link's)


def _lm():
    """examples/lm.py as a module (its model, data and optax chains)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import lm
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return lm


def worker(args) -> None:
    """One node, inside its namespace: trains every method, writes JSON."""
    sl.join_cluster(args)
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lsgd_jax

    lm = _lm()
    me = jax.process_index()
    mesh = lsgd_jax.make_mesh()  # one row ("node") per process
    rows = NamedSharding(mesh, P(lsgd_jax.data_axes(mesh)))
    iface = sl.veths(args.prefix)[me]

    def tx_bytes() -> int:  # this namespace's sysfs (ip netns exec remounts /sys)
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())

    def say(msg: str) -> None:
        if me == 0:
            print(sl.MARK + msg, flush=True)

    corpus = lm.load_corpus(args.max_mb)
    cfg = lm.ModelConfig(args.layers, args.width, args.heads, args.context)
    val = lm.validation_windows(corpus.val, args.val_windows, cfg.context)
    half = args.global_batch // 2
    out = {"process": me, "runs": []}
    for spec in args.methods.split(","):
        method = lm.parse_method(spec)
        outer = lm.outer_of_args(args, method)
        tx = lm.tx_of_args(method, args, outer)
        graphdef, params0 = lm.init_model(cfg, args.seed)
        step = lsgd_jax.data_parallel_step(lm.make_loss_fn(graphdef), tx, mesh)
        data = lm.batches(corpus.train, args.global_batch, cfg.context, args.seed)
        batches = [next(data)["tokens"][me * half : (me + 1) * half] for _ in range(args.steps)]

        def batch(s, batches=batches):
            return {"tokens": jax.make_array_from_process_local_data(rows, batches[s])}

        params = lsgd_jax.replicate(params0, mesh)
        opt_state = lsgd_jax.replicate(tx.init(params0), mesh)
        # the ledger is the compile training uses; its node-link bytes are what the
        # veths should carry (less framing)
        ledger = lsgd_jax.communication_ledger(
            step, params, opt_state, batch(0), num_steps=args.steps
        )
        say(f"{method.name}: compiled {len(ledger.phases)} programs")

        def val_loss(p, graphdef=graphdef):
            return float(lm.evaluate(graphdef, lsgd_jax.consensus(p), val))

        evals, times, losses = [(0, val_loss(params))], [], []
        before = tx_bytes()
        for s in range(args.steps):
            t0 = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, batch(s))
            losses.append(float(loss))  # waits for the step
            times.append(time.perf_counter() - t0)
            if (s + 1) % args.eval_every == 0 or s + 1 == args.steps:
                sent = tx_bytes()  # the evaluation's own bytes are not the run's
                evals.append((s + 1, val_loss(params)))
                before += tx_bytes() - sent
                say(f"{method.name}: step {s + 1}, val loss {evals[-1][1]:.4f}, "
                    f"{sum(times):.1f} s of steps")  # fmt: skip
        out["runs"].append(
            {"method": method.name, "step_s": times, "loss": losses, "evals": evals,
             "tx_bytes": tx_bytes() - before, "ledger_link_bytes": ledger.link_total()}
        )  # fmt: skip
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


def run_workers(args, argv: list[str], out_dir: pathlib.Path) -> list[dict]:
    """Both workers; stops both at once when one fails or time runs out."""
    argv = [*argv, "--worker", "--parent", str(os.getpid()), "--out", str(out_dir)]
    return sl.run_nodes(pathlib.Path(__file__), argv, args, out_dir, "", "")


def time_to(evals: list, step_s: list[float], target: float) -> tuple[int, float] | None:
    """(step, summed step seconds) at the first evaluation at or below ``target``."""
    for s, v in evals:
        if v <= target:
            return s, sum(step_s[:s])
    return None


def summarize(workers: list[dict], target: float | None) -> list[dict]:
    """One row per method: times from process 0, link bytes of both veth ends."""
    rows = []
    for i, run in enumerate(workers[0]["runs"]):
        rows.append(
            {
                "method": run["method"],
                "val_loss": run["evals"][-1][1],
                "evals": run["evals"],
                "median_step_s": statistics.median(run["step_s"]),
                "steps_s": sum(run["step_s"]),
                "link_bytes": sum(w["runs"][i]["tx_bytes"] for w in workers),
                "ledger_link_bytes": run.get("ledger_link_bytes"),
                "step_s": run["step_s"],
            }
        )
    goal = rows[0]["val_loss"] if target is None else target
    for r in rows:
        hit = time_to(r["evals"], r["step_s"], goal)
        r["target"] = goal
        r["steps_to_target"], r["time_to_target_s"] = hit if hit else (None, None)
    return rows


def markdown(rows: list[dict], command: str, rate: str) -> str:
    ddp = rows[0]
    lines = [
        f"Command: `{command}`",
        "",
        f"Link {rate}; target validation loss {ddp['target']:.4f} (checked every evaluation).",
        "",
        "| run | val loss | gap | median step (ms) | steps (s) | link MB | ledger's link MB "
        "| DDP's link bytes / this | steps to target | time to target (s) | speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, d = r["time_to_target_s"], ddp["time_to_target_s"]
        led = r.get("ledger_link_bytes")
        ledger_mb = f"{led / 1e6:,.1f}" if led is not None else "-"
        lines.append(
            f"| {r['method']} | {r['val_loss']:.4f} | {r['val_loss'] - ddp['val_loss']:+.4f} "
            f"| {r['median_step_s'] * 1e3:,.0f} | {r['steps_s']:.1f} "
            f"| {r['link_bytes'] / 1e6:,.1f} | {ledger_mb} "
            f"| {ddp['link_bytes'] / max(r['link_bytes'], 1):,.1f} | {r['steps_to_target'] or '-'} "
            f"| {f'{t:.1f}' if t is not None else 'not reached'} "
            f"| {f'{d / t:.2f}' if t and d else '-'} |"
        )
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="100mbit", help="the link's tc rate")
    ap.add_argument("--methods", default="ddp,local32,diloco32", help="DDP first")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--start", type=int, default=100, help="start_localSGD_iter (the switch)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30, help="learning-rate warm-up steps")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="diloco's outer step")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="its momentum")
    ap.add_argument("--outer-decay", action="store_true", help="as examples/lm.py's")
    ap.add_argument("--outer-floor", type=float, default=0.0, help="as examples/lm.py's")
    ap.add_argument("--outer-cooldown", type=float, default=0.0, help="as examples/lm.py's")
    ap.add_argument("--final-period", type=int, default=8, help="as examples/lm.py's")
    ap.add_argument("--final-steps", type=int, default=0, help="as examples/lm.py's")
    ap.add_argument("--qsr", type=float, default=0.0, help="as examples/lm.py's")
    ap.add_argument("--warmup-bits", type=int, default=0, choices=[0, 4, 8], help="as lm.py's")
    ap.add_argument("--global-batch", type=int, default=32, help="sequences, over all replicas")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-mb", type=float, default=4.0, help="training text, MB")
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=4, help="CPU devices per process (node)")
    ap.add_argument("--target", type=float, default=None, help="default: DDP's final val loss")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--autogroup-nice", type=int, default=None, help="as slow_link.py's")
    sl.worker_arguments(ap, PREFIX)
    args = ap.parse_args(argv)
    if not args.methods.startswith("ddp"):
        ap.error(f"--methods must start with ddp (the reference), got {args.methods!r}")
    if args.global_batch % (2 * args.devices):
        ap.error(f"--global-batch must be a multiple of 2 x --devices, got {args.global_batch}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if not sl.can_run("lm_link.py"):
        return 2
    command = sl.command_line("lm_link.py", argv)
    with sl.signals_raise():
        try:
            sl.safe_teardown(args.prefix)  # leftovers of a killed run
            sl.setup(args.prefix)
            sl.set_rate(args.rate, args.prefix)
            before = sl.link_bytes(args.prefix)
            with sl.autogroup_nice(args.autogroup_nice), tempfile.TemporaryDirectory() as tmp:
                workers = run_workers(args, argv, pathlib.Path(tmp))
            carried = sl.link_bytes(args.prefix) - before
        except (sl.CannotRun, RuntimeError) as e:
            print(f"lm_link.py: {e}", file=sys.stderr)
            return 1
        finally:
            sl.safe_teardown(args.prefix)
    rows = summarize(workers, args.target)
    print("\n" + markdown(rows, command, args.rate))
    runs = sum(r["link_bytes"] for r in rows)
    print(f"\nThe veth carried {carried / 1e6:,.1f} MB; the runs' steps {runs / 1e6:,.1f} MB.")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"command": command, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
