"""Elastic post-local SGD on N local processes: kill some, restart them, training goes on.

Run::

    python examples/elastic.py --processes 3 --devices-per-process 2 --steps 60 \\
        --kill 2@20 --restart 2@30 --json /tmp/elastic.jsonl

The launcher starts N workers (this file again), joined over 127.0.0.1 by
``lsgd_jax.elastic.initialize``. Each trains a small MLP on scikit-learn's digits with
post-local SGD (global gradient means until step 10, then node-local ones; model
averages every 4 steps) through :class:`lsgd_jax.elastic.ElasticLoop`, feeding its own
share of the training rows (process p: rows with index % N == p).

``--kill P@K`` SIGKILLs process P as soon as a live process reports starting step K
(so the kill may land mid-collective); ``--restart P@K`` starts it again (same process
index) once a live process reports step K: it joins the running job. ``--stall P@K``
stops P with SIGSTOP instead (alive but stuck); the launcher SIGKILLs it at the end.
``--pause P@K:S`` stops P at step K and continues it S seconds later: with S between the
collective and the heartbeat timeouts, the others' collectives fail while P stays a
member, and the loop retries the step on a new device order.
``--json FILE`` gets one JSON line per completed step and process
(``{"process", "step", "live_processes", "loss", "recovery_s", "failures"}``: failures
is the number of failed attempts before it) and one final line
per process (``{"process", "final": true, "consensus_sha256", "test_accuracy"}``).
The launcher exits 0 when every surviving process (and any restarted one) finished all
steps, 1 otherwise. A process that aborts (SIGABRT) counts as dead, not as a failed
survivor (gloo may abort a process whose collective a dying peer left half done),
unless process 0 hosts the coordination service and is gone.

By default the launcher first starts JAX's coordination service in a process of its
own (``python -m lsgd_jax.elastic_coordinator``) and stops it after the trainers, so
any trainer, process 0 included, may die and come back (``--kill 0@20 --restart
0@30``); ``--no-coordinator-process`` lets process 0 host it (then its death ends the
run). ``--late P`` starts process P again once the run is over: it prints one line
saying so and exits 0.

``--checkpoint-dir DIR --checkpoint-every K`` saves a checkpoint every K steps during
the run (the live processes save it; a death mid-save leaves the previous one readable)
and resumes from DIR's newest checkpoint when the job starts, on any number of
processes. ``--max-restarts R``: if the coordinator process dies (``--kill-coordinator
K`` kills it at step K), the launcher ends the trainers, restarts the coordinator and
the whole job, which resumes from the newest checkpoint, up to R times; the exit status
still says whether every surviving process finished.

``--model-state`` adds model state and aux (``step_options={"with_model_state": True,
"has_aux": True}``): each replica keeps a running mean of its inputs (batch-norm-like
statistics, subtracted from the inputs) and a count of the steps it has seen, both
averaged with the params and healed into a restarted process as the survivors' mean;
the aux is ``{"correct", "fresh", "seen"}`` (correct predictions, replicas whose model
state never saw a step, the mean count), added to each JSON step line as ``"aux"``;
the final line adds ``model_state_sha256`` (of the consensus model state) and
``model_state_spread`` (the largest difference of a local replica's model state from
it). ``--delay D``: model averages land D steps after they start.

``--fsdp``: each process is one replica that spans its devices (``step_options=
{"fsdp_axes": "local"}``): params, optimizer and averager state sharded over them, its
rows split over them inside the step, and a restarted process healed shard by shard;
post-local SGD's node-local means are then no mean at all (the replica's gradients are
the node's). The final line's ``state_bytes_per_device`` (with or without ``--fsdp``)
is the most bytes of the loop's state one device holds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

_STARTED = time.time()  # when this process started (a trainer: before its imports)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _job_args(ap: argparse.ArgumentParser) -> None:
    """The options that shape the job: the coordinator process and late starts."""
    ap.add_argument(
        "--late",
        action="append",
        default=[],
        type=int,
        metavar="P",
        help="start process P again after the run is over: it must exit 0 with one line saying so",
    )
    ap.add_argument(
        "--netns",
        default=None,
        metavar="NS0,NS1,...",
        help="run trainer i in network namespace NSi (`ip netns exec`; root) and the "
        "coordinator process in NS0, listening on all its interfaces; with "
        "--coordinator-host, its address as the other namespaces reach it "
        "(benchmarks/chaos.py --slow-link: the emulated link of benchmarks/slow_link.py)",
    )
    ap.add_argument(
        "--coordinator-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address the trainers reach the coordinator at",
    )
    ap.add_argument(
        "--coordinator-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run JAX's coordination service in a process of its own (python -m "
        "lsgd_jax.elastic_coordinator), so that process 0 too may die and come back; "
        "--no-coordinator-process: process 0 hosts it (its death ends the run)",
    )


def _checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """The options of checkpoints, and of restarting the job when the coordinator dies."""
    ap.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save checkpoints into DIR during the run, and resume from its newest one",
    )
    ap.add_argument(
        "--checkpoint-every", type=int, default=None, metavar="K", help="save every K steps"
    )
    ap.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="if the coordinator process dies, restart it and the whole job (which resumes "
        "from the newest checkpoint) up to K times",
    )
    ap.add_argument(
        "--kill-coordinator",
        type=int,
        default=None,
        metavar="K",
        help="SIGKILL the coordinator process once a live process reports starting step K (once)",
    )


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--devices-per-process", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill", action="append", default=[], metavar="P@K")
    ap.add_argument("--restart", action="append", default=[], metavar="P@K")
    ap.add_argument("--stall", action="append", default=[], metavar="P@K")
    ap.add_argument(
        "--die",
        action="append",
        default=[],
        metavar="P@K:WHERE",
        help="process P exits by itself at step K, 'between' steps (after step K-1) or "
        "'inside' step K (after the barrier, as the others enter its collectives), or "
        "'hang's inside step K (stuck in Python, heartbeats going on: the watchdog ends it)",
    )
    ap.add_argument(
        "--pause",
        action="append",
        default=[],
        metavar="P@K:S",
        help="SIGSTOP process P at step K and SIGCONT it S seconds later: shorter than the "
        "heartbeat timeout and longer than the collective timeout, the others' collectives "
        "time out while P stays a member (the attempt is retried on a new device order)",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="train with data_parallel_step alone, without the elastic loop (no failures "
        "survived): to measure what the loop costs a step",
    )
    _job_args(ap)
    _checkpoint_args(ap)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--start", type=int, default=10, help="start_localSGD_iter")
    ap.add_argument("--period", type=int, default=4, help="model averaging period")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--delay", type=int, default=0, help="model averages land D steps later")
    ap.add_argument(
        "--model-state",
        action="store_true",
        help="model state (a running mean of the inputs per replica) and aux in the step",
    )
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="each process one replica, sharded over its devices (step_options fsdp_axes='local')",
    )
    ap.add_argument(
        "--comm",
        choices=["flat", "int8", "int4"],
        default="flat",
        help="how the model averages travel (int8 / int4: quantized, two-level, with error "
        "feedback)",
    )
    ap.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="seconds of simulated compute added to every step (widens the windows in "
        "which to kill and restart)",
    )
    ap.add_argument(
        "--platform",
        choices=["cpu", "gpu"],
        default="cpu",
        help="gpu: each process takes --devices-per-process GPUs of this host (process p: "
        "GPUs p*M ... p*M+M-1), with the NCCL flags of JAX's fault-tolerance guide",
    )
    ap.add_argument(
        "--compilation-cache",
        default="default",
        metavar="DIR|default|off",
        help="where the trainers keep compiled programs, so that a restarted one loads "
        "what it compiled before (default: $LSGD_JAX_COMPILATION_CACHE or "
        "~/.cache/lsgd_jax/jax-compilation-cache; off: compile everything again)",
    )
    ap.add_argument("--heartbeat", type=int, default=3, help="heartbeat timeout (s)")
    ap.add_argument("--collective-timeout", type=int, default=5, help="seconds")
    ap.add_argument("--stall-timeout", type=float, default=120.0, help="watchdog (s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="whole run (s)")
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--events", default=None, help=argparse.SUPPRESS)
    return _checked(ap, ap.parse_args(argv))


def _checked(ap: argparse.ArgumentParser, args):
    """``args``, once the checkpoint and restart options fit together (else exit 2)."""
    if args.max_restarts < 0:
        ap.error(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if (args.max_restarts or args.kill_coordinator is not None) and not args.coordinator_process:
        ap.error("--max-restarts and --kill-coordinator need the coordinator process")
    if (args.checkpoint_dir is None) != (args.checkpoint_every is None):
        ap.error("--checkpoint-dir and --checkpoint-every go together")
    if (args.model_state or args.fsdp) and args.plain:
        ap.error("--model-state and --fsdp run in the elastic loop only (not with --plain)")
    if args.delay < 0:
        ap.error(f"--delay must be 0 or more, got {args.delay}")
    if args.netns and len(args.netns.split(",")) != args.processes:
        ap.error(f"--netns names one namespace per process ({args.processes}), got {args.netns!r}")
    if args.netns and not args.coordinator_process:
        ap.error("--netns needs the coordinator process (it runs in the first namespace)")
    return args


def _at(items: list[str], flag: str) -> list[tuple[int, int]]:
    out = []
    for item in items:
        try:
            p, k = item.split("@")
            out.append((int(p), int(k)))
        except ValueError:
            sys.exit(f"elastic.py: {flag} takes P@K (process P at step K), got {item!r}.")
    return out


def _pauses(items: list[str]) -> list[tuple[int, int, float]]:
    out = []
    for item in items:
        try:
            at, seconds = item.split(":")
            ((p, k),) = _at([at], "--pause")
            out.append((p, k, float(seconds)))
        except ValueError:
            sys.exit(f"elastic.py: --pause takes P@K:S (process P at step K, S s), got {item!r}.")
    return out


# ----------------------------------------------------------------------------- worker


def _digits():
    """scikit-learn's digits ``(x, y)``, read from the file its package ships without
    importing scikit-learn (1.8 s of every trainer's start, and so of every rejoin);
    ``load_digits`` if the file is not where it was."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = pathlib.Path(spec.submodule_search_locations[0], "datasets", "data")
        if (path / "digits.csv.gz").is_file():
            data = np.loadtxt(path / "digits.csv.gz", delimiter=",")
            return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def _data(n_processes: int, me: int):
    import numpy as np

    x, y = _digits()
    order = np.random.default_rng(0).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
    test = slice(0, 360)
    mine = np.arange(360, len(x))
    mine = mine[mine % n_processes == me]
    return (x[mine], y[mine]), (x[test], y[test])


def logits(params, x):
    import jax.numpy as jnp

    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def _stateful_loss(params, model_state, batch):
    """``--model-state``: the inputs less a running mean of them (the model state, with
    the count of steps it has seen); aux: correct predictions, fresh replicas, the count."""
    import jax
    import jax.numpy as jnp
    import optax

    mean = 0.9 * model_state["mean"] + 0.1 * batch["x"].mean(0)
    out = logits(params, batch["x"] - jax.lax.stop_gradient(mean))
    loss = optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()
    seen = model_state["seen"]
    aux = {
        "correct": (out.argmax(-1) == batch["y"]).sum().astype(jnp.int32),
        "fresh": (seen < 0.5).astype(jnp.int32),
        "seen": seen,
    }
    return loss, ({"mean": mean, "seen": seen + 1.0}, aux)


def _model(args):
    """The MLP's initial params, logits, loss and the post-local SGD optimizer."""
    import numpy as np
    import optax

    import lsgd_jax

    def plain_loss(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits(params, batch["x"]), batch["y"]
        ).mean()

    loss_fn = _stateful_loss if args.model_state else plain_loss

    rng = np.random.default_rng(1)
    init = {
        "w1": (rng.standard_normal((64, 64)) / 8).astype(np.float32),
        "b1": np.zeros(64, np.float32),
        "w2": (rng.standard_normal((64, 10)) / 8).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }
    # With --fsdp a replica is a process: its gradients are the node's mean already
    # after the switch, and the averages' two levels would be one.
    hook = {"process_group": "node", "post_local_gradient_allreduce": False} if args.fsdp else {}
    tx = optax.chain(
        lsgd_jax.post_local_sgd(args.start, **hook),
        optax.sgd(args.lr, momentum=0.9),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(
                args.period,
                args.start,
                delay=args.delay,
                communication=None
                if args.comm == "flat"
                else lsgd_jax.comm.quantized(
                    8 if args.comm == "int8" else 4, two_level=not args.fsdp
                ),
            )
        ),
    )
    return init, logits, loss_fn, tx


def _say_timing(me: int, stamps: list[float], skip: int = 10) -> None:
    """Process 0 prints the mean seconds per step after the first ``skip`` (compiles)."""
    if me == 0 and len(stamps) > skip + 1:
        per_step = (stamps[-1] - stamps[skip]) / (len(stamps) - 1 - skip)
        print(f"TIMING {1000 * per_step:.3f} ms/step", flush=True)


def _plain(args, loss_fn, tx, init, batch_fn) -> None:
    """The same training with ``data_parallel_step`` alone (every process, no failures)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import lsgd_jax

    mesh = lsgd_jax.make_mesh()
    layout = lsgd_jax.elastic.Layout(
        tuple(range(args.processes)), args.process_id, args.devices_per_process, 0, mesh
    )
    step_fn = lsgd_jax.data_parallel_step(loss_fn, tx, mesh, donate=False)
    params, opt_state = lsgd_jax.replicate(init, mesh), lsgd_jax.replicate(tx.init(init), mesh)
    rows = NamedSharding(mesh, P(lsgd_jax.data_axes(mesh)))
    stamps = []
    for s in range(args.steps):
        batch = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(rows, x), batch_fn(s, layout)
        )
        params, opt_state, loss = step_fn(params, opt_state, batch)
        float(loss)  # wait for the step, as the elastic loop does
        stamps.append(time.perf_counter())
    _say_timing(args.process_id, stamps)
    lsgd_jax.elastic.shutdown()


def worker(args) -> None:
    from lsgd_jax import elastic

    elastic.initialize(
        f"{args.coordinator_host}:{args.port}",
        args.processes,
        args.process_id,
        platform=args.platform,
        num_cpu_devices=args.devices_per_process if args.platform == "cpu" else None,
        local_device_ids=None
        if args.platform == "cpu"
        else [
            args.process_id * args.devices_per_process + k for k in range(args.devices_per_process)
        ],
        heartbeat_timeout_s=args.heartbeat,
        collective_timeout_s=args.collective_timeout,
        external_coordinator=args.coordinator_process,
        compilation_cache={"default": True, "off": False}.get(
            args.compilation_cache, args.compilation_cache
        ),
    )
    import jax
    import numpy as np

    # Programs this process compiled: compile requests not served from the persistent
    # compilation cache (JAX times both as "backend_compile_duration").
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: (
            compiles.append(1) if name.endswith("backend_compile_duration") else None
        )
    )
    jax.monitoring.register_event_listener(
        lambda name, **kw: compiles.append(-1) if name.endswith("/cache_hits") else None
    )
    me, rows = args.process_id, 16  # rows per replica
    (xs, ys), (xt, yt) = _data(args.processes, me)
    events = open(args.events, "a", buffering=1) if args.events else None
    out = open(args.json, "a", buffering=1) if args.json else None

    def emit(f, record):
        if f is not None:
            f.write(json.dumps(record) + "\n")

    dies = {}
    for item in args.die:
        at, where = item.split(":")
        for p, k in _at([at], "--die"):
            if p == me and not os.environ.get("LSGD_ELASTIC_RESTARTED"):
                dies[(k, where)] = True

    def batch_fn(step, layout):
        emit(events, {"process": me, "start": step})
        if dies.get((step, "inside")):
            os._exit(3)
        if dies.get((step, "hang")):  # stuck in Python: heartbeats go on, the step never ends
            time.sleep(10**6)
        time.sleep(args.step_time)
        rng = np.random.default_rng([step, me])
        idx = rng.choice(len(xs), rows * layout.devices_per_process, replace=False)
        return {"x": xs[idx], "y": ys[idx]}

    init, logits, loss_fn, tx = _model(args)
    if args.plain:
        _plain(args, loss_fn, tx, init, batch_fn)
        return
    stamps = []

    def on_step(r):
        stamps.append(time.perf_counter())
        line = {
            "process": me,
            "step": r.step,
            "live_processes": list(r.live_processes),
            "loss": r.loss,
            "recovery_s": r.recovery_s,
            "failures": len(r.failures),
            "since_start_s": time.time() - _STARTED,  # this process's own start
            "compiles": sum(compiles),
        }
        if r.aux is not None:
            line["aux"] = {k: v.item() for k, v in r.aux.items()}
        emit(out, line)
        if dies.get((r.step + 1, "between")):
            os._exit(3)

    ckpt = {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every}
    ckpt["step_options"] = {"fsdp_axes": "local"} if args.fsdp else {}
    if args.model_state:
        ckpt["step_options"].update({"with_model_state": True, "has_aux": True})
        ckpt["init_model_state"] = {"mean": np.zeros(64, np.float32), "seen": np.float32(0)}
    loop = elastic.ElasticLoop(
        loss_fn, tx, init, batch_fn, stall_timeout_s=args.stall_timeout, on_step=on_step, **ckpt
    )
    result = loop.run(args.steps)
    _say_timing(me, stamps)
    final = {"process": me, "final": True, "state_bytes_per_device": _bytes_per_device(result)}
    if args.model_state:
        model, stats = jax.device_get(loop.consensus(result, model_state=True))
        final.update(_model_state_summary(result.model_state, stats))
        xt = xt - stats["mean"]
    else:
        model = jax.device_get(loop.consensus(result))
    final["consensus_sha256"] = _sha256(model)
    final["test_accuracy"] = float((np.asarray(logits(model, xt)).argmax(-1) == yt).mean())
    emit(out, final)
    emit(events, {"process": me, "final": True})
    loop.shutdown()


def _bytes_per_device(result) -> int:
    """The most bytes of the loop's state (params, optimizer and averager state, model
    state) that one of this process's devices holds."""
    import jax

    held: dict = {}
    for leaf in jax.tree.leaves(result.state):
        for s in leaf.addressable_shards:
            held[s.device] = held.get(s.device, 0) + s.data.nbytes
    return max(held.values())


def _sha256(tree) -> str:
    import numpy as np

    return hashlib.sha256(
        b"".join(np.ascontiguousarray(tree[k]).tobytes() for k in sorted(tree))
    ).hexdigest()


def _model_state_summary(per_replica, consensus) -> dict:
    """The consensus model state's digest, and how far this process's replicas are from
    it (0.0: every replica holds the mean, as right after an average)."""
    import numpy as np

    spread = max(
        float(np.max(np.abs(np.asarray(s.data)[0] - consensus[k][s.index[1:]])))
        for k, x in per_replica.items()
        for s in x.addressable_shards
    )
    return {"model_state_sha256": _sha256(consensus), "model_state_spread": spread}


# ----------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end(procs: dict[int, subprocess.Popen]) -> None:
    """SIGKILLs every trainer still running (a stopped one too) and reaps them all."""
    for p in procs.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
    for p in procs.values():
        p.wait()


class _Launcher:
    def __init__(self, args, argv: list[str], events: pathlib.Path):
        self.args, self.argv, self.events = args, argv, events
        self.port = _free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        self.gone: set[int] = set()  # killed (and not restarted since)
        self.stopped: set[int] = set()
        self.paused: dict[int, float] = {}  # --pause: process -> when to SIGCONT it
        self._read = 0
        self.started = -1  # the highest step a live process reported starting
        self.coordinator: subprocess.Popen | None = None
        self.coordinator_killed = False  # --kill-coordinator done
        self.restarts = 0  # of the coordinator and the job (--max-restarts)

    def _env(self) -> dict[str, str]:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        env.pop("XLA_FLAGS", None)
        env.pop("JAX_NUM_CPU_DEVICES", None)
        return env

    def start_coordinator(self) -> None:
        """The coordination service in a process of its own (before the trainers)."""
        cmd = [sys.executable, "-m", "lsgd_jax.elastic_coordinator", "--port", str(self.port)]
        host = "0.0.0.0" if self.args.netns else "127.0.0.1"  # 0.0.0.0: lo and the veth
        cmd = self._in_namespace(0, cmd) + ["--processes", str(self.args.processes)]
        cmd += ["--host", host]
        cmd += ["--heartbeat-timeout", str(self.args.heartbeat)]
        self.coordinator = subprocess.Popen(cmd, env=self._env())

    def stop_coordinator(self) -> None:
        """Stops the coordinator (after every trainer has exited) and reaps it."""
        c = self.coordinator
        if c is not None and c.poll() is None:
            c.terminate()
            try:
                c.wait(timeout=10)
            except subprocess.TimeoutExpired:
                c.kill()
        if c is not None:
            c.wait()

    def _in_namespace(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` run in trainer ``i``'s network namespace (``--netns``), if any
        (``ip netns exec`` execs it: the process, its PID and its signals are the
        command's own)."""
        if not self.args.netns:
            return cmd
        return ["ip", "netns", "exec", self.args.netns.split(",")[i], *cmd]

    def start(self, i: int) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), *self.argv]
        cmd = self._in_namespace(i, cmd)
        cmd += ["--port", str(self.port), "--process-id", str(i), "--events", str(self.events)]
        env = self._env()
        if i in self.procs:
            env["LSGD_ELASTIC_RESTARTED"] = "1"  # a --die applies to the first start only
        self.procs[i] = subprocess.Popen(cmd, env=env)
        self.gone.discard(i)

    def poll_events(self) -> None:
        with open(self.events) as f:
            f.seek(self._read)
            for line in f:
                if not line.endswith("\n"):
                    break
                self._read += len(line)
                event = json.loads(line)
                if "start" in event and event["process"] not in self.gone:
                    self.started = max(self.started, event["start"])

    def act(self, kills, restarts, stalls) -> None:
        for p, proc in self.procs.items():
            code = proc.poll()
            if code in (3, 75) and p not in self.gone:  # a --die, or its watchdog
                self.gone.add(p)
                why = "(--die)" if code == 3 else "(its watchdog: stall_timeout_s)"
                print(f"elastic.py: process {p} exited by itself {why}", flush=True)
            elif code == -signal.SIGABRT and p not in self.gone and self._0_is_not_special():
                # gloo can abort a process whose collective meets a peer that died in
                # the middle of it: one more dead process, which the others survive.
                self.gone.add(p)
                print(f"elastic.py: process {p} aborted (SIGABRT); the others go on", flush=True)
        for p, k in list(kills):
            if self.started >= k:
                self.procs[p].kill()
                self.gone.add(p)
                kills.remove((p, k))
                print(f"elastic.py: killed process {p} at step {self.started}", flush=True)
        for p, k in list(stalls):
            if self.started >= k:
                self.procs[p].send_signal(signal.SIGSTOP)
                self.gone.add(p)
                self.stopped.add(p)
                stalls.remove((p, k))
                print(f"elastic.py: stopped process {p} at step {self.started}", flush=True)
        for p, k in list(restarts):
            if self.started >= k and p in self.gone and self.procs[p].poll() is not None:
                self.start(p)
                restarts.remove((p, k))
                print(f"elastic.py: restarted process {p} at step {self.started}", flush=True)

    def pause(self, pauses: list[tuple[int, int, float]]) -> None:
        """``--pause P@K:S``: SIGSTOP at step K, SIGCONT S seconds later (P stays live)."""
        now = time.monotonic()
        for p, k, seconds in list(pauses):
            if self.started >= k and self.procs[p].poll() is None:
                self.procs[p].send_signal(signal.SIGSTOP)
                self.paused[p] = now + seconds
                pauses.remove((p, k, seconds))
                print(f"elastic.py: paused process {p} at step {self.started}", flush=True)
        for p, until in list(self.paused.items()):
            if now >= until:
                self.procs[p].send_signal(signal.SIGCONT)
                del self.paused[p]
                print(f"elastic.py: resumed process {p} at step {self.started}", flush=True)

    def watch_coordinator(self) -> None:
        """``--kill-coordinator K``; and if the coordinator died, up to
        ``--max-restarts`` times: every trainer is ended, the coordinator restarted (on a
        new port) and every trainer started again (the job resumes from its newest
        checkpoint)."""
        c, k = self.coordinator, self.args.kill_coordinator
        if c is None:
            return
        if k is not None and self.started >= k and not self.coordinator_killed:
            c.kill()
            c.wait()
            self.coordinator_killed = True
            print(f"elastic.py: killed the coordinator process at step {self.started}", flush=True)
        if c.poll() is None or self.restarts >= self.args.max_restarts:
            return
        self.restarts += 1
        print(
            f"elastic.py: the coordinator process died; restarting it and the job (restart "
            f"{self.restarts} of {self.args.max_restarts}), which resumes from its newest "
            "checkpoint",
            flush=True,
        )
        _end(self.procs)
        self.port = _free_port()
        self.start_coordinator()
        self.gone.clear()
        self.stopped.clear()
        for i in range(self.args.processes):
            self.start(i)

    def _0_is_not_special(self) -> bool:
        """Whether the others survive process 0's death (the service runs elsewhere)."""
        return self.coordinator is not None or 0 not in self.gone

    def finished(self) -> int | None:
        """0 once every surviving process finished (exit status 0), 1 if one did not (or
        none survived); None while some still run."""
        live = [i for i in self.procs if i not in self.gone]
        codes = {i: self.procs[i].poll() for i in live}
        if any(c is None for c in codes.values()):
            return None
        bad = {i: c for i, c in codes.items() if c != 0}
        if bad:
            print(f"elastic.py: processes ended with {bad}", file=sys.stderr, flush=True)
        return 1 if bad or not live or not self._0_is_not_special() else 0

    def late(self, processes: list[int], deadline: float) -> int:
        """Starts ``processes`` again after the run is over; 0 if each exits with 0."""
        for p in processes:
            self.start(p)
            print(f"elastic.py: started process {p} after the run was over", flush=True)
        codes = {}
        for p in processes:
            try:
                codes[p] = self.procs[p].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[p] = None
        if any(c != 0 for c in codes.values()):
            print(f"elastic.py: late processes ended with {codes}", file=sys.stderr, flush=True)
            return 1
        return 0


def launch(args, argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kills, restarts = _at(args.kill, "--kill"), _at(args.restart, "--restart")
    stalls, pauses = _at(args.stall, "--stall"), _pauses(args.pause)
    with tempfile.TemporaryDirectory() as tmp:
        events = pathlib.Path(tmp) / "events.jsonl"
        events.touch()
        run = _Launcher(args, argv, events)
        deadline = time.monotonic() + args.timeout
        try:
            if args.coordinator_process:
                run.start_coordinator()
            for i in range(args.processes):
                run.start(i)
            while True:
                run.poll_events()
                run.watch_coordinator()
                run.act(kills, restarts, stalls)
                run.pause(pauses)
                code = run.finished()
                if code is not None:  # nobody left to reach a pending --restart's step
                    return max(code, run.late(args.late, deadline)) if args.late else code
                if time.monotonic() > deadline:
                    print(f"elastic.py: timed out after {args.timeout} s", file=sys.stderr)
                    return 1
                time.sleep(0.02)
        finally:
            _end(run.procs)
            run.stop_coordinator()  # after the trainers: they talk to it to the end


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.process_id is not None:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
