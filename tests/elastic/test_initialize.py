"""lsgd_jax.elastic.initialize and shutdown: bad arguments refused before any JAX or
network work, and the threads initialize(num_cpu_devices=n) gives XLA's CPU pool
(PJRT_NPROC=2n, as simulate_cpu_devices does), so that no process warns about the
library's own setup (issue 33)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import jax
import pytest

import lsgd_jax


def test_initialize_refuses_a_running_backend():
    jax.devices()  # the tests' backend is up
    with pytest.raises(RuntimeError, match="before any other JAX call"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, 0)
    with pytest.raises(ValueError, match="platform must be"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, 0, platform="tpu")


# Misuse is refused before any JAX or network work (these run with the tests' backend
# already up: each check comes before initialize's "backend is running" one).
@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("127.0.0.1:1", 2, 0), {"num_cpu_devices": 0}, "num_cpu_devices.*got 0"),
        (("127.0.0.1:1", 2, 0), {"num_cpu_devices": -2}, "num_cpu_devices.*got -2"),
        (("127.0.0.1:1", 2, -1), {}, r"process_id must be in \[0, 2\).*got -1"),
        (("127.0.0.1:1", 1, 1), {}, r"process_id must be in \[0, 1\).*got 1;"),
        (("127.0.0.1", 2, 0), {}, "'host:port'.*got '127.0.0.1'"),
        (("127.0.0.1:http", 2, 1), {}, "'host:port'.*got '127.0.0.1:http'"),
        (("127.0.0.1:70000", 2, 0), {}, "'host:port'.*got '127.0.0.1:70000'"),
        (("127.0.0.1:1", 0, 0), {}, "num_processes.*got 0"),
        (("127.0.0.1:1", 2, 0), {"initialization_timeout_s": 0}, "initialization_timeout_s"),
        (("127.0.0.1:1", 2, 0), {"heartbeat_timeout_s": -3}, "heartbeat_timeout_s"),
    ],
)
def test_initialize_refuses_bad_counts_ids_addresses_and_timeouts(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        lsgd_jax.elastic.initialize(*args, **kwargs)


def test_initialize_refuses_an_external_coordinator_that_is_not_a_bool():
    with pytest.raises(TypeError, match="external_coordinator must be True or False.*'yes'"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, 0, external_coordinator="yes")


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_shutdown_refuses_a_timeout_that_is_not_positive(timeout_s):
    with pytest.raises(ValueError, match=f"timeout_s must be a positive number.*got {timeout_s}"):
        lsgd_jax.elastic.shutdown(None, timeout_s)


# initialize(num_cpu_devices=n) and XLA's CPU threads: a fresh process each.

BODY = """
import os, sys, warnings
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # 2 cores, before JAX starts
warnings.simplefilter("always")
import lsgd_jax
lsgd_jax.elastic.initialize("127.0.0.1:{port}", 1, 0, num_cpu_devices=4, compilation_cache=False)
import jax
lsgd_jax.make_mesh(1, 4)
print(jax.device_count(), os.environ.get("PJRT_NPROC"))
jax.distributed.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(pjrt_nproc: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.pop("PJRT_NPROC", None)
    if pjrt_nproc is not None:
        env["PJRT_NPROC"] = pjrt_nproc
    code = textwrap.dedent(BODY).format(port=free_port())
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize(("given", "want"), [(None, "8"), ("6", "6")])
def test_initialize_sets_the_threads_its_cpu_devices_need(given, want):
    # 4 devices on 2 cores: a pool of 4 threads warned ("XLA's CPU client runs this
    # process's 4 CPU devices on a pool of 4 threads"); now PJRT_NPROC=8 unless set
    out = run(given)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["4", want], out.stderr[-3000:]
    warned = "XLA's CPU client runs" in out.stderr
    assert warned == (given == "6"), out.stderr[-3000:]  # a user's 6 is kept (and warned of)
