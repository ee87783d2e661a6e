"""Simulated CPU devices, and the threads XLA's CPU client needs to run them.

XLA's CPU client runs every device's programs on one pool of ``max(PJRT_NPROC, devices)``
threads (``PJRT_NPROC`` unset: the cores this process may use), and it also launches
programs from that pool. Each device queues at most 32 programs; when a device's queue
is full, the launch of the next program holds a pool thread until a queued one ends. An
all-reduce over ``m`` devices needs ``m`` pool threads at once, one a device. With fewer
than ``2 * m`` threads, up to ``m`` blocked launches can leave the running all-reduce
short of a thread: its devices wait in XLA's rendezvous and, after 40 s, XLA aborts the
process ("Termination timeout for all reduce ... only k of them arrived"). A queue fills
whenever programs are dispatched faster than the devices run them: a loop that does
not wait for its steps, or a burst of small programs (one a leaf of a model).
"""

from __future__ import annotations

import os
import re
import warnings

import jax
from jax.sharding import Mesh

from lsgd_jax._core import _compat, _validate

ENV = "PJRT_NPROC"
_FALLBACK = "NPROC"  # XLA reads it when PJRT_NPROC is unset or not an integer
_warned = False  # one warning a process
_ours: str | None = None  # the PJRT_NPROC simulate_cpu_devices set (None: none)


def simulate_cpu_devices(n: int) -> None:
    """Runs JAX on ``n`` simulated CPU devices, with the threads they need.

    Sets ``jax_platforms="cpu"`` and ``jax_num_cpu_devices=n``, and ``PJRT_NPROC`` (the
    size of XLA's CPU thread pool) to ``2 * n`` unless the user set it already (a value
    an earlier call set is replaced): with fewer
    threads than twice the devices, a program with collectives can wait forever for a
    thread and XLA aborts the process (see :func:`check_cpu_threads`). Call it before
    anything asks JAX for its devices or runs a computation (these settings take effect
    only when JAX starts its backend). Called once the backend runs on ``n`` CPU
    devices, it does nothing (the pool is then what it is: :func:`make_mesh` warns if
    it is too small).

    Args:
      n: the number of devices (of this process), >= 1.

    Raises:
      RuntimeError: JAX's backend has already started, with another platform or
        another number of devices; the message says how to start it right.

    Example:
      >>> import lsgd_jax
      >>> lsgd_jax.mesh.simulate_cpu_devices(8)  # first, before any JAX computation
      >>> import jax
      >>> jax.local_device_count()
      8
    """
    n = _validate.positive_int(n, "simulate_cpu_devices: n")
    if _compat.backends_are_initialized():
        backend, count = jax.default_backend(), jax.local_device_count()
        if backend == "cpu" and count == n:
            return
        raise RuntimeError(
            f"simulate_cpu_devices({n}): JAX's backend has already started, on {count} "
            f"{backend} device(s), and the devices are fixed when it starts. Call "
            "simulate_cpu_devices first, before anything asks JAX for its devices or "
            "runs a computation (right after `import jax`), or start Python with "
            f"JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES={n} {ENV}={2 * n} in the environment."
        )
    global _ours
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
    if os.environ.get(ENV) in (None, _ours):  # unset, or an earlier call's: ours to set
        _ours = os.environ[ENV] = str(2 * n)


def cpu_threads(num_devices: int) -> int:
    """The threads of XLA's CPU client pool for a process with ``num_devices`` CPU
    devices, counted as XLA counts them: ``max(PJRT_NPROC, num_devices)``, where a
    ``PJRT_NPROC`` of 0 or less counts 0 (the pool is then the devices); with
    ``PJRT_NPROC`` unset or not an integer, ``NPROC`` likewise; with neither, the cores
    this process may use.

    ``PJRT_NPROC`` is read from the environment now; XLA reads it once, when JAX starts
    its backend, so a value set after that has no effect (and is not seen here as such).

    Example:
      >>> from lsgd_jax.mesh._threads import cpu_threads
      >>> cpu_threads(8) >= 8  # never fewer than the devices
      True
    """
    return max(_setting()[0], num_devices)


def _atoi(text: str) -> int | None:
    """``text`` as XLA reads it (``absl::SimpleAtoi`` into an int): an optionally signed
    decimal integer between blanks, in int32's range; None when it is not one."""
    match = re.fullmatch(r"\s*([+-]?[0-9]+)\s*", text, re.ASCII)
    if match is None or not -(2**31) <= int(match.group(1)) < 2**31:
        return None
    return int(match.group(1))


def _setting() -> tuple[int, str]:
    """``(threads, where they come from)``: the threads XLA takes from the environment
    (before the device count raises them) and how the warning names their source."""
    skipped = []  # set but not an integer: XLA reads on
    for name in (ENV, _FALLBACK):
        raw = os.environ.get(name)
        if raw is None:
            continue
        value = _atoi(raw)
        if value is None:
            skipped.append(f"{name}={raw!r} (not an integer XLA can read: it ignores it)")
            continue
        source = f"{name}={value}"
        if value <= 0:
            source = f"{name}={raw!r} (not a positive integer: XLA counts it as 0 threads)"
        return max(value, 0), ", ".join([*skipped, source])
    cores = _cores()
    if not skipped:
        return cores, f"{ENV}, unset here, so the {cores} cores"
    return cores, f"{', '.join(skipped)}, so the {cores} cores"


def _cores() -> int:
    """The cores XLA counts (its ``MaxParallelism``): those this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpu_threads(mesh: Mesh) -> bool:
    """Warns (once a process) when XLA's CPU thread pool is too small for ``mesh``.

    On the CPU backend, XLA runs each device's programs, and launches them, on one pool
    of ``max(PJRT_NPROC, devices)`` threads (``PJRT_NPROC`` unset: the cores). A program
    with collectives over the ``m`` devices of ``mesh`` in this process needs ``m`` of
    them at once, and once a device has 32 programs queued (a loop that does not wait
    for its steps, an evaluation loop, a small program for each leaf of a model) the
    launch of the next one holds a thread per device while it waits. With fewer than
    ``2 * m`` threads the collective can then never start and XLA aborts the process
    after 40 s ("Termination timeout for all reduce ... only k of them arrived"). The
    warning names the remedy: ``PJRT_NPROC=<2 * devices>`` in the environment before
    JAX starts, or :func:`simulate_cpu_devices`. :func:`make_mesh` and :func:`replicate`
    call it.

    Args:
      mesh: the mesh the program will run on (a ``jax.sharding.Mesh``).

    Returns:
      True when the pool is large enough (or the devices are not CPUs, or there is
      only one in this process), False when it is not (the warning is given the first
      time in a process).

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax.mesh._threads import check_cpu_threads
      >>> check_cpu_threads(lsgd_jax.make_mesh(1, 1))  # one device: no collective
      True
    """
    global _warned
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"check_cpu_threads: mesh must be a jax.sharding.Mesh (e.g. lsgd_jax.make_mesh"
            f"(2, 4)), got {mesh!r} ({type(mesh).__name__})."
        )
    here = jax.process_index()
    devices = [d for d in mesh.devices.flat if d.process_index == here]
    if len(devices) < 2 or any(d.platform != "cpu" for d in devices):
        return True
    local = jax.local_device_count(backend="cpu")
    threads, need = cpu_threads(local), 2 * len(devices)
    if threads >= need:
        return True
    if not _warned:
        _warned = True
        warnings.warn(_message(len(devices), local, threads), RuntimeWarning, stacklevel=3)
    return False


def _message(m: int, local: int, threads: int) -> str:
    source = _setting()[1]
    return (
        f"XLA's CPU client runs this process's {local} CPU devices on a pool of {threads} "
        f"threads (the larger of the device count and {source}), fewer than twice the "
        f"{m} devices of this mesh: a program with collectives can then wait forever for "
        "a thread (once a device has 32 programs queued, launching the next holds a "
        'thread per device) and XLA aborts the process after 40 s ("Termination timeout '
        'for all reduce ... only k of them arrived"). Remedy: start Python with '
        f"{ENV}={2 * local} in the environment (`{ENV}={2 * local} python train.py`; it "
        "must be set before JAX starts its backend), or call "
        f"lsgd_jax.simulate_cpu_devices({local}) before anything uses JAX."
    )


def _reset_warning() -> None:
    """Lets :func:`check_cpu_threads` warn again (for tests)."""
    global _warned
    _warned = False
