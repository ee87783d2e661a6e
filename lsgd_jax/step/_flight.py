"""What a step's calls leave running on the device: at most a few of them, and their
phase flags, read some calls later (reading them at once would wait for each step).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np


class InFlight:
    """At most ``limit`` dispatched steps ahead of the host (None: no limit).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.step._flight import InFlight
      >>> bound = InFlight(2)
      >>> for k in range(4):
      ...     bound.add(jnp.asarray(k))   # waits for call k - 2
      >>> len(bound)
      2
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._losses: collections.deque = collections.deque()

    def add(self, loss: Any) -> None:
        """Counts a dispatched step (by its loss); waits for the oldest beyond the limit."""
        if self.limit is None:
            return
        self._losses.append(loss)
        if len(self._losses) > self.limit:
            self._losses.popleft().block_until_ready()

    def __len__(self) -> int:
        return len(self._losses)


class PhaseChecks:
    """The ``ok`` flags of phase programs, read ``lag`` calls after they ran (a program
    that met a state in another phase changed nothing and said so in its flag).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.step._flight import PhaseChecks
      >>> checks = PhaseChecks(lag=1)
      >>> checks.add(1, 0, jnp.ones(8, bool))
      >>> checks.add(2, 1, jnp.zeros(8, bool))   # read at the next add
      >>> checks.add(3, 1, jnp.ones(8, bool))
      Traceback (most recent call last):
      ...
      RuntimeError: data_parallel_step: call 2 ran the program of phase 1, but ...
    """

    def __init__(self, lag: int = 16) -> None:
        self.lag = lag
        self._unread: collections.deque = collections.deque()

    def add(self, call: int, mode: int, ok: Any) -> None:
        """Keeps call ``call``'s flag; reads the older half once ``2 * lag`` wait."""
        self._unread.append((call, mode, ok))
        if len(self._unread) >= 2 * self.lag:
            for _ in range(self.lag):
                _read(*self._unread.popleft())


def _read(call: int, mode: int, ok: Any) -> None:
    # The phase comes from the counters, equal on every replica: one flag tells.
    flag = ok.addressable_data(0) if hasattr(ok, "addressable_data") else ok
    if not np.all(np.asarray(flag)):
        raise RuntimeError(
            f"data_parallel_step: call {call} ran the program of phase {mode}, but the "
            "optimizer state was in another phase, so that step changed nothing (and "
            "the later ones until now may not either). The step follows the step "
            "counters on the host, assuming each call advances every hook and averager "
            "by one; something in the optimizer skipped an update. Build the step with "
            "specialize='switch', which branches on the device."
        )
