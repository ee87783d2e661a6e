"""lsgd_jax.elastic._attempts: the watchdog that ends a stalled attempt (compilation
does not count), and the check that this process is still among the live ones."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

import lsgd_jax
from lsgd_jax.elastic import _attempts


def test_the_watchdog_does_not_count_compilation_but_does_count_a_stall():
    fired = []

    def slow_to_trace(x):
        time.sleep(3.5)  # in the trace: compilation, for the watchdog (limit 1.5 s)
        return x + 1

    x = jnp.zeros(3)
    dog = _attempts.Watchdog(1.5, on_stall=fired.append)
    try:
        dog.arm("compiling step")  # a first call: trace, lower, compile, run
        jax.block_until_ready(jax.jit(slow_to_trace)(x))
        dog.disarm()
        assert fired == []
        dog.arm("stalled step")
        deadline = time.monotonic() + 60  # a stall in Python: the watchdog fires
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fired == ["stalled step"]
    finally:
        dog.disarm()
        dog.close()


def test_a_process_the_others_declared_dead_is_told_to_restart():
    """After a SIGSTOP longer than the heartbeat timeout the live set no longer holds
    this process: it raises LeftBehindError (not posted as a user error, so the others
    go on), instead of a StopIteration that ended every process (found by the soak)."""
    from lsgd_jax.elastic import _attempts

    with pytest.raises(
        lsgd_jax.elastic.LeftBehindError, match=r"process 0 is not among .*\[1, 2\]"
    ):
        _attempts.check_members(((1, 4), (2, 4)), 0, external=True)
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match="process 0"):
        _attempts.check_members(((1, 4), (2, 4)), 1, external=False)
    assert _attempts.check_members(((1, 4), (2, 4)), 1, external=True) == ((1, 4), (2, 4))
    assert lsgd_jax.elastic.LeftBehindError in _attempts._NOT_THE_USERS
