"""Simulated CPU devices and XLA's CPU thread pool (issue 33, item 13).

XLA's CPU client runs and launches every device's programs on one pool of
max(PJRT_NPROC or cores, devices) threads; with fewer than twice the devices, a burst of
programs with collectives fills the devices' queues, blocked launches hold the threads a
running all-reduce needs, and XLA aborts the process. The processes here start JAX with 8
devices, pinned to 2 cores (as CI's machine has), so that XLA and the check count alike.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lsgd_jax
from lsgd_jax.mesh import _threads

PRELUDE = """
import os, sys, warnings
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # 2 cores, before JAX starts
warnings.simplefilter("always")
import jax, jax.numpy as jnp, numpy as np
import lsgd_jax
"""


def run(body, pjrt_nproc=None, timeout_s=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.pop("PJRT_NPROC", None)
    if pjrt_nproc is not None:
        env["PJRT_NPROC"] = str(pjrt_nproc)
    if timeout_s is not None:  # XLA's rendezvous gives up (aborts) sooner than its 40 s
        env["XLA_FLAGS"] = (
            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 "
            f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout_s}"
        )
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


SIMULATED = """
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
"""


def test_make_mesh_warns_once_with_the_remedy_when_the_pool_is_too_small():
    out = run(SIMULATED + "lsgd_jax.make_mesh(); lsgd_jax.make_mesh(2, 4); print('built')")
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-3000:]
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr  # once a process
    assert "8 CPU devices on a pool of 8 threads" in out.stderr
    assert "PJRT_NPROC, unset here, so the 2 cores" in out.stderr
    assert "Remedy: start Python with PJRT_NPROC=16" in out.stderr
    assert "lsgd_jax.simulate_cpu_devices(8)" in out.stderr


@pytest.mark.slow
def test_a_pjrt_nproc_under_twice_the_devices_warns_too():
    out = run(SIMULATED + "lsgd_jax.make_mesh()", pjrt_nproc=15)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr
    assert "a pool of 15 threads (the larger of the device count and PJRT_NPROC=15)" in out.stderr


def test_no_warning_with_the_remedy_or_the_helper():
    out = run(SIMULATED + "lsgd_jax.make_mesh()", pjrt_nproc=16)
    assert out.returncode == 0 and "Warning" not in out.stderr, out.stderr[-3000:]
    helper = run(
        """
        lsgd_jax.mesh.simulate_cpu_devices(8)
        lsgd_jax.make_mesh()
        print(jax.default_backend(), jax.device_count(), os.environ["PJRT_NPROC"])
        """
    )
    assert helper.returncode == 0 and "Warning" not in helper.stderr, helper.stderr[-3000:]
    assert helper.stdout.split() == ["cpu", "8", "16"]


@pytest.mark.slow
def test_the_helper_keeps_a_pjrt_nproc_already_set():
    out = run(
        """
        lsgd_jax.mesh.simulate_cpu_devices(4)
        print(jax.device_count(), os.environ["PJRT_NPROC"])
        """,
        pjrt_nproc=32,
    )
    assert out.stdout.split() == ["4", "32"], out.stderr[-3000:]


def test_the_helper_refuses_a_started_backend_with_other_devices(monkeypatch):
    assert len(jax.devices("cpu")) == 8  # the tests' backend has started (conftest)
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    assert lsgd_jax.mesh.simulate_cpu_devices(8) is None  # the same: nothing to do
    assert "PJRT_NPROC" not in os.environ  # (too late to matter: not set)
    with pytest.raises(RuntimeError) as e:
        lsgd_jax.mesh.simulate_cpu_devices(4)
    assert "JAX's backend has already started, on 8 cpu device(s)" in str(e.value)
    assert "JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=4 PJRT_NPROC=8" in str(e.value)
    with pytest.raises(ValueError, match="simulate_cpu_devices: n"):
        lsgd_jax.mesh.simulate_cpu_devices(0)


def test_check_cpu_threads_reads_the_pool_size(monkeypatch):
    mesh = lsgd_jax.make_mesh(2, 4)
    monkeypatch.setattr(_threads, "_warned", False)
    monkeypatch.setenv("PJRT_NPROC", "16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lsgd_jax.mesh.check_cpu_threads(mesh) is True
        assert lsgd_jax.mesh.check_cpu_threads(lsgd_jax.make_mesh(1, 1)) is True
    monkeypatch.setenv("PJRT_NPROC", "12")
    with pytest.warns(RuntimeWarning, match="pool of 12 threads") as caught:
        assert lsgd_jax.mesh.check_cpu_threads(mesh) is False
        assert lsgd_jax.mesh.check_cpu_threads(mesh) is False  # no second warning
    assert len(caught) == 1
    # a mesh of 4 of the 8 devices: 8 threads (the device count) are enough
    assert lsgd_jax.mesh.check_cpu_threads(lsgd_jax.make_mesh(1, 4)) is True


FLOOD = """
from jax.sharding import NamedSharding, PartitionSpec as P
{setup}
mesh = jax.make_mesh((8,), ("d",))
x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))
f = jax.jit(lambda x: jnp.mean(x, axis=0))  # an all-reduce over the 8 devices
jax.block_until_ready([f(x) for _ in range(3000)])  # dispatched without waiting
print("ran")
"""


@pytest.mark.slow
def test_the_cause_a_burst_of_collectives_aborts_with_fewer_threads_than_twice_the_devices():
    # The mechanism the warning describes, and its remedy: 3,000 all-reduces dispatched
    # without waiting abort the process with a pool of 8 threads (as with 15: measured),
    # and run with 16.
    aborted = run(FLOOD.format(setup=SIMULATED), timeout_s=5)
    assert aborted.returncode == -6, aborted.stdout  # SIGABRT
    assert "Termination timeout for `all reduce" in aborted.stderr
    assert "Expected 8 threads to join the rendezvous" in aborted.stderr
    helped = run(FLOOD.format(setup="lsgd_jax.mesh.simulate_cpu_devices(8)"), timeout_s=5)
    assert helped.returncode == 0 and "ran" in helped.stdout, helped.stderr[-3000:]


def test_consensus_of_a_many_leaf_model_is_one_program_and_does_not_abort():
    # Before: consensus ran one small program with an all-reduce per leaf, dispatched
    # without waiting: on 8 devices with a pool of 8 threads (2 cores) the first
    # consensus of a 6-layer transformer aborted the process (examples/lm.py, issue 33).
    out = run(
        SIMULATED
        + textwrap.dedent(
            """
        warnings.simplefilter("ignore")  # the pool warning: this is the case it warns of
        mesh = lsgd_jax.make_mesh(2, 4)
        rng = np.random.default_rng(0)
        tree = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(300)]
        per_replica = lsgd_jax.replicate(tree, mesh)
        per_replica = [x * np.arange(1, 9, dtype=np.float32)[:, None, None] for x in per_replica]
        for _ in range(3):
            means = lsgd_jax.consensus(per_replica)
            firsts = lsgd_jax.unreplicate(per_replica)
        want = [np.asarray(x).mean(0) for x in per_replica]
        np.testing.assert_allclose([np.asarray(m) for m in means], want, rtol=1e-6)
        np.testing.assert_array_equal([np.asarray(f) for f in firsts], tree)
        print("averaged")
        """
        ),
        timeout_s=5,
    )
    assert out.returncode == 0 and "averaged" in out.stdout, out.stderr[-3000:]


def test_consensus_and_unreplicate_keep_their_results_layout():
    mesh = lsgd_jax.make_mesh(2, 4)
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "i": jnp.arange(3), "h": jnp.ones(2, jnp.bfloat16)}
    rep = lsgd_jax.replicate(tree, mesh)
    for out in (lsgd_jax.consensus(rep), lsgd_jax.unreplicate(rep)):
        assert {k: (v.dtype, v.sharding.spec) for k, v in out.items()} == {
            k: (v.dtype, jax.sharding.PartitionSpec()) for k, v in tree.items()
        }
        np.testing.assert_array_equal(out["w"], tree["w"])
    fsdp = lsgd_jax.replicate(jnp.ones((3, 8)), mesh, axes=("node",), shard_over="local")
    assert lsgd_jax.consensus(fsdp).sharding.spec == jax.sharding.PartitionSpec(None, "local")
    host = {"w": np.ones((8, 3), np.float32), "i": np.arange(8)}
    assert isinstance(lsgd_jax.unreplicate(host)["w"], np.ndarray)  # NumPy stays NumPy
    assert int(lsgd_jax.consensus(host)["i"]) == 0


def test_replicate_checks_a_mesh_of_the_users_own(monkeypatch):
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    monkeypatch.setattr(_threads, "_warned", False)
    monkeypatch.setenv("PJRT_NPROC", "4")
    with pytest.warns(RuntimeWarning, match="Remedy: start Python with PJRT_NPROC=16"):
        lsgd_jax.replicate({"w": jnp.ones(2)}, mesh)


# --- issue 33: a second call, bad arguments, PJRT_NPROC values XLA does not count -------


def test_a_second_call_before_the_backend_starts_replaces_its_own_pjrt_nproc():
    # simulate_cpu_devices(4) then (8): PJRT_NPROC was the first call's 8, and make_mesh
    # (2, 4) warned; now 16. A value the user set is kept, whatever the calls.
    out = run(
        """
        lsgd_jax.simulate_cpu_devices(4)
        lsgd_jax.simulate_cpu_devices(8)
        lsgd_jax.make_mesh(2, 4)
        print(jax.device_count(), os.environ["PJRT_NPROC"])
        """
    )
    assert out.returncode == 0 and "Warning" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.split() == ["8", "16"]
    kept = run(
        """
        lsgd_jax.simulate_cpu_devices(4)
        lsgd_jax.simulate_cpu_devices(8)
        print(jax.device_count(), os.environ["PJRT_NPROC"])
        """,
        pjrt_nproc=12,
    )
    assert kept.stdout.split() == ["8", "12"], kept.stderr[-3000:]


@pytest.mark.parametrize("bad", [None, [1, 2], "mesh"])
def test_check_cpu_threads_names_an_argument_that_is_not_a_mesh(bad):
    with pytest.raises(TypeError, match="check_cpu_threads: mesh must be a jax.sharding.Mesh"):
        lsgd_jax.mesh.check_cpu_threads(bad)


@pytest.mark.parametrize(
    ("value", "threads", "says"),
    [
        # not an integer: XLA reads on (NPROC, then the cores)
        ("abc", 2, "PJRT_NPROC='abc' (not an integer XLA can read: it ignores it), so the 2 cores"),
        # an integer <= 0: XLA counts 0 threads, the pool is the device count
        ("0", 0, "PJRT_NPROC='0' (not a positive integer: XLA counts it as 0 threads)"),
        ("-3", 0, "PJRT_NPROC='-3' (not a positive integer: XLA counts it as 0 threads)"),
    ],
)
def test_a_pjrt_nproc_that_is_not_a_positive_int_is_named_as_such(
    monkeypatch, value, threads, says
):
    # XLA's DefaultThreadPoolSize: absl::SimpleAtoi(PJRT_NPROC), max(0, n) when it
    # parses, else NPROC, else the cores; the pool is max(that, devices). Measured with
    # 1 device on 2 cores: PJRT_NPROC=0 and -3 start as many threads as 1, "abc" as unset.
    monkeypatch.setattr(_threads, "_cores", lambda: 2)
    monkeypatch.setattr(_threads, "_warned", False)
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("PJRT_NPROC", value)
    assert _threads._setting()[0] == threads
    with pytest.warns(RuntimeWarning) as caught:
        assert lsgd_jax.mesh.check_cpu_threads(lsgd_jax.make_mesh(2, 4)) is False
    message = str(caught[0].message)
    assert "a pool of 8 threads (the larger of the device count and " + says in message
    assert "unset here" not in message


def test_the_pool_is_counted_as_xla_counts_it(monkeypatch):
    # Before: PJRT_NPROC=0 counted as unset, the cores (here 32: no warning for a pool
    # that is in fact the 8 devices); NPROC was not read.
    monkeypatch.setattr(_threads, "_cores", lambda: 32)
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("PJRT_NPROC", "0")
    assert _threads.cpu_threads(8) == 8
    monkeypatch.setenv("PJRT_NPROC", " 20 ")  # blanks around it: XLA reads 20
    assert _threads.cpu_threads(8) == 20
    monkeypatch.setenv("PJRT_NPROC", "x")
    monkeypatch.setenv("NPROC", "12")
    assert _threads._setting() == (
        12,
        "PJRT_NPROC='x' (not an integer XLA can read: it ignores it), NPROC=12",
    )
    monkeypatch.delenv("PJRT_NPROC")
    assert _threads._setting() == (12, "NPROC=12")
