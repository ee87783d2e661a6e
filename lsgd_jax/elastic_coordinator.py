"""JAX's coordination service in a process of its own, for an elastic run.

By default process 0 of a ``jax.distributed`` job hosts the coordination service (the
key-value store, heartbeats, barriers every process uses), so process 0's death ends
every process. Run the service here instead, once per job, before the trainers, and
start every trainer with ``lsgd_jax.elastic.initialize(..., external_coordinator=True)``:
then any trainer, process 0 included, may die and come back. Stop it (SIGTERM or
SIGINT) after the trainers have exited::

    python -m lsgd_jax.elastic_coordinator --port 9876 --processes 3

It prints one line once it listens, and exits 0 when stopped.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

__all__ = ["main", "serve"]


def serve(
    port: int,
    num_processes: int,
    *,
    host: str = "[::]",
    heartbeat_timeout_s: int = 3,
    stop: threading.Event | None = None,
) -> None:
    """Runs the coordination service of an elastic job until ``stop`` is set.

    Args:
      port: the TCP port to listen on (the trainers' ``coordinator_address`` port).
      num_processes: the job's trainers (their ``num_processes``).
      host: the address to bind (``"[::]"``: every interface, as JAX does;
        ``"127.0.0.1"``: this machine only).
      heartbeat_timeout_s: seconds without heartbeats after which a trainer is dead
        (use the trainers' ``heartbeat_timeout_s``).
      stop: an event that ends the service when set (default: SIGTERM or SIGINT).

    Returns:
      None, once stopped (the service is shut down).

    Example:
      >>> from lsgd_jax.elastic_coordinator import serve
      >>> serve(9876, 3, host="127.0.0.1")  # doctest: +SKIP
    """
    from lsgd_jax._core import _compat, _validate

    _validate.positive_int(num_processes, "elastic_coordinator: num_processes")
    _validate.positive_int(heartbeat_timeout_s, "elastic_coordinator: heartbeat_timeout_s")
    if not _validate._is_int(port) or not 0 < port < 65536:
        raise ValueError(f"elastic_coordinator: port must be in 1-65535, got {port!r}.")
    if stop is None:
        stop = threading.Event()

        def on_signal(*_: Any) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    service = _compat.distributed_runtime_service(
        f"{host}:{port}", num_processes, heartbeat_timeout_s, 5
    )
    print(
        f"lsgd_jax.elastic_coordinator: serving {num_processes} processes on {host}:{port}",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        service.shutdown()


def main(argv: list[str] | None = None) -> int:
    """The command line: ``python -m lsgd_jax.elastic_coordinator --port P --processes N``.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      The exit status (0 once stopped by SIGTERM or SIGINT).

    Example:
      >>> from lsgd_jax.elastic_coordinator import main
      >>> main(["--port", "9876", "--processes", "3"])  # doctest: +SKIP
    """
    ap = argparse.ArgumentParser(
        prog="python -m lsgd_jax.elastic_coordinator", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    ap.add_argument("--processes", type=int, required=True, help="trainers in the job")
    ap.add_argument("--host", default="[::]", help="address to bind (default: all)")
    ap.add_argument(
        "--heartbeat-timeout", type=int, default=3, help="seconds (the trainers' heartbeat)"
    )
    args = ap.parse_args(argv)
    try:
        serve(
            args.port,
            args.processes,
            host=args.host,
            heartbeat_timeout_s=args.heartbeat_timeout,
        )
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
