"""Starting and ending a process of an elastic run: initialize() (JAX's distributed
runtime with recoverability, collective timeouts, gloo on CPU, the compilation cache)
and shutdown().
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any

import jax
import numpy as np

from lsgd_jax._core import _validate
from lsgd_jax.elastic import _membership, _process
from lsgd_jax.elastic._process import CoordinatorLostError
from lsgd_jax.mesh import simulate_cpu_devices
from lsgd_jax.step import use_compilation_cache

logger = logging.getLogger("lsgd_jax.elastic")

_CPU_FLAGS = "--xla_cpu_collective_timeout_seconds={t}"
# From JAX's fault-tolerance guide: a failed NCCL collective must not end the process,
# and collectives with a failed participant must be cancelled.
_GPU_FLAGS = (
    "--xla_gpu_nccl_terminate_on_error=false",
    "--xla_gpu_nccl_async_execution=true",
    "--xla_gpu_nccl_blocking_communicators=false",
)
# What initialize() set, for the checks of how the timeouts relate (ElasticLoop's).
_TIMEOUTS: dict[str, int] = {}
_GPU_ENV = {
    "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1",
    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1",
}


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    platform: str = "cpu",
    num_cpu_devices: int | None = None,
    local_device_ids: list[int] | None = None,
    heartbeat_timeout_s: int = 3,
    collective_timeout_s: int = 5,
    initialization_timeout_s: int = 60,
    external_coordinator: bool = False,
    compilation_cache: str | bool = True,
) -> None:
    """``jax.distributed.initialize`` for an elastic run; call it before any JAX work.

    Turns on ``jax_enable_recoverability`` (a dead peer no longer ends this process),
    makes collectives with a dead participant fail after ``collective_timeout_s``
    instead of hanging (CPU: ``--xla_cpu_collective_timeout_seconds``; GPU: the NCCL
    flags of JAX's fault-tolerance guide), selects gloo on CPU, and connects. How to
    launch, and how the timeouts must relate: docs/failures.md.

    Args:
      coordinator_address: ``host:port`` of the coordination service: process 0's, or
        with ``external_coordinator`` that of ``lsgd_jax.elastic_coordinator``.
      num_processes: processes in the job (a restarted one counts once).
      process_id: this process's index; a restarted process reuses its old index.
      platform: ``"cpu"`` or ``"gpu"``.
      num_cpu_devices: CPU devices for this process (CPU only; default JAX's), with the
        threads they need (``PJRT_NPROC``, as :func:`lsgd_jax.simulate_cpu_devices`).
      local_device_ids: the GPUs this process uses (e.g. ``[process_id]`` for one
        process per GPU on one host); default all it sees.
      heartbeat_timeout_s: seconds without heartbeats after which a process is dead.
      collective_timeout_s: seconds a collective waits for a missing peer (CPU).
      initialization_timeout_s: seconds to wait for the coordinator (then fail).
      external_coordinator: the service runs in a process of its own (``python -m
        lsgd_jax.elastic_coordinator``), so that any trainer, process 0 included, may
        die and come back.
      compilation_cache: keep compiled programs on disk (see
        :func:`lsgd_jax.use_compilation_cache`): True for its default folder, a path,
        or False to leave JAX's settings alone.

    Returns:
      None.

    Raises:
      ValueError: a bad argument value (checked before any JAX or network work).
      TypeError: an argument of the wrong type (checked likewise).
      RuntimeError: JAX's backend is already running.
      CoordinatorLostError: no coordination service at the address after
        ``initialization_timeout_s`` (process 0 is gone or not started).

    Example:
      >>> import lsgd_jax.elastic as elastic
      >>> elastic.initialize("127.0.0.1:9876", 3, 0, num_cpu_devices=2)  # doctest: +SKIP
      >>> # with `python -m lsgd_jax.elastic_coordinator --port 9876 --processes 3`:
      >>> elastic.initialize("127.0.0.1:9876", 3, 0, external_coordinator=True)  # doctest: +SKIP
    """
    from lsgd_jax._core import _compat

    _check_initialize_args(
        coordinator_address,
        num_processes,
        process_id,
        platform,
        num_cpu_devices,
        local_device_ids,
        (heartbeat_timeout_s, collective_timeout_s, initialization_timeout_s),
    )
    if not isinstance(external_coordinator, bool):
        raise TypeError(
            f"initialize: external_coordinator must be True or False, got {external_coordinator!r}."
        )
    if not isinstance(compilation_cache, (str, os.PathLike, bool)):
        raise TypeError(
            "initialize: compilation_cache must be True, False or a folder's path, got "
            f"{compilation_cache!r}."
        )
    if _compat.backends_are_initialized():
        raise RuntimeError(
            "lsgd_jax.elastic.initialize: JAX's backend is already running, so its "
            "collective timeouts can no longer be set; call initialize() before any "
            "other JAX call (jax.devices(), creating arrays, jit)."
        )
    if process_id != 0 or external_coordinator:  # else process 0 starts the service
        _wait_for_coordinator(coordinator_address, initialization_timeout_s, external_coordinator)
    flags = [_CPU_FLAGS.format(t=collective_timeout_s)]
    if platform == "gpu":
        flags += list(_GPU_FLAGS)
        os.environ.update(_GPU_ENV)
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    _TIMEOUTS.update(
        heartbeat=heartbeat_timeout_s, collective=collective_timeout_s, processes=num_processes
    )
    jax.config.update("jax_enable_recoverability", True)
    if compilation_cache is not False:
        use_compilation_cache(None if compilation_cache is True else compilation_cache)
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if num_cpu_devices is not None:  # and PJRT_NPROC, the threads the devices need
            simulate_cpu_devices(num_cpu_devices)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        initialization_timeout=initialization_timeout_s,
        # Process 0's own service, unused when the job's service runs elsewhere: any free port.
        coordinator_bind_address="127.0.0.1:0" if external_coordinator else None,
    )
    _process.set_external_coordinator(external_coordinator)
    if external_coordinator and process_id == 0:
        _membership.forget_global_topology()


def _check_initialize_args(
    address: Any,
    num_processes: Any,
    process_id: Any,
    platform: Any,
    num_cpu_devices: Any,
    local_device_ids: Any,
    timeouts: tuple[Any, Any, Any],
) -> None:
    """initialize's argument checks, all before any JAX or network work."""
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"initialize: platform must be 'cpu' or 'gpu', got {platform!r}.")
    _host_port(address)
    n = _validate.positive_int(num_processes, "initialize: num_processes")
    if not _validate._is_int(process_id):  # a bool, a float, a str: the wrong type
        raise TypeError(_validate._not_int(process_id, "initialize: process_id"))
    if not 0 <= process_id < n:
        raise ValueError(
            f"initialize: process_id must be in [0, {n}) for num_processes={n}, got "
            f"{process_id!r}; give each process its own index 0 .. {n - 1} (a restarted "
            "process reuses its old one)."
        )
    _validate.optional_positive_int(num_cpu_devices, "initialize: num_cpu_devices")
    if local_device_ids is not None and not (
        isinstance(local_device_ids, (list, tuple))
        and all(_validate._is_int(i) and i >= 0 for i in local_device_ids)
    ):
        raise ValueError(
            "initialize: local_device_ids must be None or a list of device indices (ints "
            f">= 0), got {local_device_ids!r}."
        )
    names = ("heartbeat_timeout_s", "collective_timeout_s", "initialization_timeout_s")
    for name, value in zip(names, timeouts):
        _validate.positive_int(value, f"initialize: {name}")


def _host_port(address: Any) -> tuple[str, int]:
    """``(host, port)`` of a ``"host:port"`` address; ValueError saying the form else."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"initialize: coordinator_address must be 'host:port' (e.g. '10.0.0.1:9876', "
            f"with the port process 0's service listens on, 1-65535), got {address!r}."
        )
    return host, int(port)


def _positive_seconds(value: Any, name: str, none_ok: bool = False) -> float | None:
    """``value`` as seconds > 0 (finite; None too when ``none_ok``), else a clear error."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{name} must be a positive number of seconds{' or None' if none_ok else ''}, "
            f"got {value!r} ({type(value).__name__})."
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a positive number of seconds"
            f"{' (or None: never)' if none_ok else ''}, got {value!r}."
        )
    return float(value)


def _wait_for_coordinator(address: str, timeout_s: float, external: bool = False) -> None:
    """Returns once ``address`` accepts TCP connections; CoordinatorLostError after
    ``timeout_s`` (else JAX would retry for its whole initialization timeout and then
    abort the process)."""
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host or "127.0.0.1", port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                host = (
                    "the coordinator process (python -m lsgd_jax.elastic_coordinator) is"
                    if external
                    else "process 0 is"
                )
                raise CoordinatorLostError(
                    f"lsgd_jax.elastic.initialize: no coordination service at {address} "
                    f"after {timeout_s} s ({e}); {host} gone (the run is over or failed) "
                    f"or not started. Start the job again with {host.split(' is')[0]}."
                ) from e
            time.sleep(0.2)


def shutdown(processes: Any = None, timeout_s: float = 30.0) -> None:
    """Leaves an elastic job cleanly: every process calls it at the end.

    With the coordination service in a process of its own (``initialize(...,
    external_coordinator=True)``), each process just says it is done and disconnects.
    Else process 0 hosts the service, so it leaves last: it waits (up to ``timeout_s``)
    until every other process of ``processes`` has said it is done and has
    disconnected. If it left first, JAX would end the others (they are still talking to
    the service when they shut down).

    Args:
      processes: the live processes (e.g. ``result.layout.processes``); default all.
      timeout_s: how long process 0 waits for each of the others.

    Returns:
      None.

    Example:
      >>> lsgd_jax.elastic.shutdown(result.layout.processes)  # doctest: +SKIP
    """
    _positive_seconds(timeout_s, "lsgd_jax.elastic.shutdown: timeout_s")
    c, me = _membership.client(), jax.process_index()
    if me != 0 or _process.external_coordinator():
        c.key_value_set(f"{_membership.PREFIX}/done/{me}", "1", allow_overwrite=True)
        jax.distributed.shutdown()
        return
    others = [p for p in (processes or range(jax.process_count())) if p != 0]
    for p in others:
        try:
            c.blocking_key_value_get(f"{_membership.PREFIX}/done/{p}", int(timeout_s * 1000))
        except Exception:  # a process that died after its last step
            logger.warning("lsgd_jax.elastic: process %d did not say it is done", p)
    # A barrier of the live ones among them: it returns once the others have
    # disconnected (or their heartbeats stopped).
    c.get_live_nodes([0, *others])
    jax.distributed.shutdown()
