"""Post-local SGD on N local processes, each with M CPU devices: a cluster on one machine.

Run::

    python -m lsgd_jax.elastic.launch_local --processes 2 --devices 4 --steps 60

(``python examples/launch_local.py`` with the same options does the same.) The launcher
starts N worker processes (this module again, with ``--process-id``), one per "node",
joined by ``jax.distributed`` over 127.0.0.1 and gloo (JAX's CPU collectives). Every
worker:

1. sets its CPU device count and gloo, then calls ``jax.distributed.initialize``;
2. builds the global mesh with ``lsgd_jax.make_mesh()``: one row ("node") per process,
   that process's devices along "local" (the subgroup of post-local SGD); with
   ``--nodes K`` (K < N) each node is N / K whole processes instead;
3. feeds only its own rows of every global batch, with
   ``jax.make_array_from_process_local_data``;
4. trains with ``post_local_sgd`` + SGD with momentum + ``model_averaging``, saving a
   checkpoint every ``--ckpt-every`` steps to ``--ckpt-dir`` and resuming from the
   newest one when started again (kill it and rerun: it continues where it stopped).

If a worker dies, the others would wait in their next collective until JAX's heartbeat
timeout (``--heartbeat`` seconds) ends them, so the launcher stops them at once and
reports which worker failed. On a real cluster, SLURM or the TPU runtime start the
processes instead of this launcher; see docs/many_hosts.md. (It is not an elastic run:
for one that survives a dead process, see ``lsgd_jax.elastic.ElasticLoop``.)

Example:
  >>> from lsgd_jax.elastic import launch_local
  >>> args = launch_local.parse(["--processes", "4", "--devices", "1", "--nodes", "2"])
  >>> args.processes, args.devices, args.nodes, args.steps
  (4, 1, 2, 60)
  >>> launch_local.worker_command(["--steps", "20"], port=1234, process_id=0)[1:]
  ['-m', 'lsgd_jax.elastic.launch_local', '--steps', '20', '--port', '1234', '--process-id', '0']
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

__all__ = ["launch", "main", "parse", "worker", "worker_command"]

MODULE = "lsgd_jax.elastic.launch_local"  # what the workers run (__name__ is __main__ there)


def _count(least: int, example: str) -> Any:
    """An argparse ``type``: an int ``>= least``, else an error naming the value and an
    example of a good one."""

    def parse_count(text: str) -> int:
        value: int | None = None
        with contextlib.suppress(ValueError):
            value = int(text)
        if value is None or value < least:
            wanted = "a positive int" if least == 1 else f"an int >= {least}"
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}; e.g. {example}")
        return value

    return parse_count


def _seconds(example: str) -> Any:
    """An argparse ``type``: a positive, finite number of seconds."""

    def parse_seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(
                f"must be a positive number of seconds, got {text!r}; e.g. {example}"
            )
        return value

    return parse_seconds


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's (and a worker's) options from ``argv`` (default: ``sys.argv``).

    A bad value ends the program with argparse's usage message naming it and a good
    one (exit status 2): a count below 1 (``--processes``, ``--devices``, ``--nodes``,
    ``--steps``, ``--period``, ``--ckpt-every``, ``--heartbeat``), a negative
    ``--start``, a ``--timeout`` that is not a positive number, or ``--nodes`` that
    does not divide ``--processes``.
    """
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--processes", type=_count(1, "--processes 2"), default=2, help="N processes (nodes)"
    )
    ap.add_argument(
        "--devices", type=_count(1, "--devices 4"), default=4, help="M CPU devices per process"
    )
    ap.add_argument(
        "--nodes",
        type=_count(1, "--nodes 1"),
        default=None,
        help="nodes (mesh rows); default one per process, fewer groups whole processes "
        "into a node (like one process per GPU on a multi-GPU host)",
    )
    ap.add_argument("--steps", type=_count(1, "--steps 60"), default=60)
    ap.add_argument("--start", type=_count(0, "--start 10"), default=10, help="start_localSGD_iter")
    ap.add_argument(
        "--period", type=_count(1, "--period 4"), default=4, help="model averaging period"
    )
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint folder (resumes from it)")
    ap.add_argument("--ckpt-every", type=_count(1, "--ckpt-every 20"), default=20)
    ap.add_argument(
        "--heartbeat",
        type=_count(1, "--heartbeat 20"),
        default=20,
        help="seconds to declare a peer dead",
    )
    ap.add_argument(
        "--timeout", type=_seconds("--timeout 600"), default=600, help="seconds for the whole run"
    )
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.nodes is not None and args.processes % args.nodes:
        divisors = ", ".join(str(k) for k in range(1, args.processes + 1) if not args.processes % k)
        ap.error(
            f"argument --nodes: {args.nodes} nodes cannot each hold whole processes of "
            f"--processes {args.processes}; give a divisor of it ({divisors}), or leave "
            "--nodes out (one node per process)."
        )
    return args


# ----------------------------------------------------------------------------- worker


def _join(args: argparse.Namespace) -> None:
    """This worker's devices, gloo, the compilation cache, and ``jax.distributed``."""
    import jax

    from lsgd_jax.mesh import simulate_cpu_devices
    from lsgd_jax.step import use_compilation_cache

    simulate_cpu_devices(args.devices)  # and PJRT_NPROC, the threads the devices need
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    use_compilation_cache()  # a restarted worker loads its programs
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.processes,
        process_id=args.process_id,
        heartbeat_timeout_seconds=args.heartbeat,
    )


def _problem(me: int, din: int = 16, per_device: int = 8) -> tuple[Any, Any, Any]:
    """``(teacher, rows(step), loss_fn)``: a noisy tanh teacher; ``rows(step)`` is this
    process's share of the global batch of ``step``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    teacher = np.random.default_rng(0).standard_normal((din, 1)).astype(np.float32)

    def rows(step: int) -> dict[str, Any]:
        rng = np.random.default_rng([1, step, me])
        x = rng.standard_normal((per_device * jax.local_device_count(), din)).astype(np.float32)
        y = np.tanh(x @ teacher) + 0.1 * rng.standard_normal((len(x), 1)).astype(np.float32)
        return {"x": x, "y": y}

    def loss_fn(params: Any, batch: Any) -> Any:
        pred = jnp.tanh(batch["x"] @ params["w"] + params["b"])
        return jnp.mean((pred - batch["y"]) ** 2)

    return teacher, rows, loss_fn


def _resume(ckpt_dir: str | None, state: Any, say: Any) -> tuple[int, Any]:
    """``(first step, state)``: from the newest checkpoint in ``ckpt_dir``, if any."""
    from lsgd_jax import checkpoint

    latest = checkpoint.latest_checkpoint_step(ckpt_dir) if ckpt_dir else None
    if not ckpt_dir or latest is None:
        return 0, state
    # Checks that every process restored the same step counters (else it raises).
    state = checkpoint.restore_checkpoint(ckpt_dir, state, step=latest)
    say(f"resumed from the checkpoint of step {latest}")
    return latest, state


def worker(args: argparse.Namespace) -> None:
    """One worker (``args.process_id``): joins the others, trains, checkpoints, resumes."""
    _join(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lsgd_jax import checkpoint
    from lsgd_jax.averaging import PeriodicModelAverager, model_averaging
    from lsgd_jax.hook import post_local_sgd
    from lsgd_jax.mesh import consensus, data_axes, make_mesh, replicate
    from lsgd_jax.step import data_parallel_step

    me = jax.process_index()
    mesh = make_mesh(args.nodes)  # default (processes, devices): a node per process
    rows = NamedSharding(mesh, P(data_axes(mesh)))

    def say(message: str) -> None:
        if me == 0:
            print(message, flush=True)

    per_node = args.processes // (args.nodes or args.processes)
    say(f"mesh {dict(mesh.shape)}: {per_node} process(es) per node")

    teacher, my_rows, loss_fn = _problem(me)
    tx = optax.chain(
        post_local_sgd(args.start),  # global gradient mean, then node-local
        optax.sgd(0.1, momentum=0.9),
        model_averaging(PeriodicModelAverager(args.period, args.start)),
    )
    step_fn = data_parallel_step(loss_fn, tx, mesh)
    p0 = {"w": jnp.zeros((teacher.shape[0], 1)), "b": jnp.zeros(1)}
    state = {"params": replicate(p0, mesh), "opt_state": replicate(tx.init(p0), mesh)}

    first, state = _resume(args.ckpt_dir, state, say)
    params, opt_state = state["params"], state["opt_state"]
    t0 = time.perf_counter()
    for s in range(first, args.steps):
        batch = jax.make_array_from_process_local_data(rows, my_rows(s))
        params, opt_state, loss = step_fn(params, opt_state, batch)
        if s % 10 == 0 or s == args.steps - 1:
            say(f"step {s:4d}  loss {float(loss):.4f}")
        if args.ckpt_dir and (s + 1) % args.ckpt_every == 0:
            saved = {"params": params, "opt_state": opt_state}
            checkpoint.save_checkpoint(args.ckpt_dir, s + 1, saved)

    model = consensus(params)  # a collective: every process calls it
    x_test = np.random.default_rng(2).standard_normal((512, teacher.shape[0]))
    test = {"x": x_test.astype(np.float32)}
    test["y"] = np.tanh(test["x"] @ teacher)
    test_loss = float(jax.jit(loss_fn)(jax.device_get(model), test))
    say(
        f"done: {args.steps - first} steps in {time.perf_counter() - t0:.1f} s; "
        f"test loss of the averaged model {test_loss:.4f}"
    )
    jax.distributed.shutdown()


# ----------------------------------------------------------------------------- launcher


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(argv: list[str], port: int, process_id: int) -> list[str]:
    """The command line of worker ``process_id``: this module with the launcher's
    ``argv``, the coordinator's ``port`` and the worker's id."""
    return [
        sys.executable,
        "-m",
        MODULE,
        *argv,
        "--port",
        str(port),
        "--process-id",
        str(process_id),
    ]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Starts ``args.processes`` workers with ``argv`` and waits for them: 0 when every
    one exits with 0; 1 (after stopping the others) when one fails or the run outlasts
    ``args.timeout`` seconds."""
    # SIGTERM (e.g. from a scheduler) stops the workers too: the finally below runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = free_port()
    env = dict(os.environ)  # the workers import the lsgd_jax this one runs
    here = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    procs = [
        subprocess.Popen(worker_command(argv, port, i), env=env) for i in range(args.processes)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                print(
                    f"launch_local: worker {failed[0]} exited with {codes[failed[0]]}; stopping "
                    "the others (they would wait in a collective until the heartbeat timeout).",
                    file=sys.stderr,
                )
                return 1
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"launch_local: timed out after {args.timeout} s.", file=sys.stderr)
                return 1
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    """The launcher, or (with ``--process-id``) one worker; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.process_id is not None:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
