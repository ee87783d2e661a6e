"""lsgd_jax.elastic.initialize(num_cpu_devices=n) gives XLA's CPU pool the threads the
devices need (PJRT_NPROC=2n), as simulate_cpu_devices does (issue 33): before, each
process warned about the library's own setup."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

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
