"""An averager's buffers in host memory between averages (``offload_state=True``).

The buffers are the state an average reads and writes but the steps between averages
never touch: the anchor, the outer optimizer's state, the error-feedback residual and a
delayed average's start and mean. They live in ``"pinned_host"`` memory; an average
moves them onto the device, uses them and moves them back (``_average_call.run``), so
a step that does not average leaves them where they are. The counters (step, counts,
``skipped``) stay on the device: the step's phase is read from them.
"""

from __future__ import annotations

from typing import Any

import jax

from lsgd_jax._core import _state_protocol as sp
from lsgd_jax.averaging._averager_state import ModelAveragerState

BUFFERS = sp.names(ModelAveragerState, sp.BUFFER, sp.RESIDUAL)  # per replica, like params
HOST = "pinned_host"


def buffers(state: ModelAveragerState, space: Any) -> ModelAveragerState:
    """``state`` with its buffers moved to ``space`` (inside a jitted computation).

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from lsgd_jax.averaging._offload import buffers
      >>> avg = lsgd_jax.PeriodicModelAverager(2, delta=True, offload_state=True)
      >>> st = jax.jit(lambda s: buffers(s, jax.memory.Space.Host))(avg.init(jnp.ones(3)))
      >>> st.anchor.sharding.memory_kind
      'pinned_host'
    """
    moved = {
        name: jax.tree.map(lambda x: jax.device_put(x, space), getattr(state, name))
        for name in BUFFERS
        if getattr(state, name) is not None
    }
    return state.replace(**moved)


def is_offloaded(node: Any) -> bool:
    """Whether ``node`` is the state of an averager built with ``offload_state=True``."""
    return isinstance(node, ModelAveragerState) and bool(
        getattr(node.averager, "offload_state", None)
    )


def place(state: ModelAveragerState, put: Any) -> ModelAveragerState:
    """``state`` placed by ``put(leaf, memory_kind)``: its buffers in host memory, its
    counters on the device."""
    fields = {
        name: jax.tree.map(lambda x, kind=HOST if name in BUFFERS else None: put(x, kind), value)
        for name, value in ((n, getattr(state, n)) for n in sp.data_names(state))
    }
    return state.replace(**fields)
