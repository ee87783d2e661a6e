"""A delayed average's mean, taken by a program of its own while the next steps compute.

With ``delay=tau`` an averager starts a global average at call t and lands it at call
t + tau; nothing in between needs the mean. Taken inside step t's program, the
collective still stalls step t (XLA:CPU runs a program's collectives and compute one
after the other). So ``data_parallel_step`` compiles its steps *deferred*: a starting
average only records its params (``ModelAveragerState.deferred``), the step returns that
averager state as an extra output (a buffer no later step donates), and this module
takes the mean in a separate program dispatched from a background thread, while the
main thread dispatches steps t + 1, ...; before step t + tau runs, the result is written
into the optimizer state. The same maths (``_average_call.finish_deferred``), so the
same numbers up to the order of the float sums.

Every process issues the background programs in the same order (one at a time) and the
steps in the same order. The background program runs on the same devices listed in
another order (the data axes reversed): a different device order is a different
collective context for gloo (its key is the device list), so the two threads'
collectives never share a communicator. A mean over all replicas does not depend on
their order, and reversing the data axes keeps each node's devices together (a node's
row stays a row) and each device's model-axis position.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lsgd_jax import _average_call, _phase
from lsgd_jax._averager_state import ModelAveragerState

# What the deferred program changes in the averager's state (the rest is the step's).
_FIELDS = ("inflight_mean", "inflight_level", "anchor", "outer_state", "outer_count", "comm_state")


def reordered(mesh: Mesh, axes: tuple[str, ...]) -> Mesh:
    """``mesh`` with its devices in reverse order along ``axes`` (same axis names).

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax._overlap import reordered
      >>> mesh = lsgd_jax.make_mesh(2, 2)
      >>> [d.id for d in reordered(mesh, ("node", "local")).devices.flat]
      [3, 2, 1, 0]
    """
    devices = mesh.devices
    for a in axes:
        devices = np.flip(devices, axis=mesh.axis_names.index(a))
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Each array of ``tree`` as an array over ``mesh`` (same spec), made of the same
    per-device buffers: no data moves, each device keeps what it holds."""

    def one(x: jax.Array) -> jax.Array:
        spec = cast(NamedSharding, x.sharding).spec  # the step's arrays are on a mesh
        sharding = NamedSharding(mesh, spec)
        buffers = {s.device: s.data for s in x.addressable_shards}
        devices = sharding.addressable_devices_indices_map(x.shape)
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [buffers[d] for d in devices]
        )

    return jax.tree.map(one, tree)


class Overlap:
    """Takes the mean of one delayed averager's started averages in the background.

    Args:
      mesh: the step's mesh.
      axes: its data axes.
      position: the averager's index among the optimizer state's branching states.
    """

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], position: int) -> None:
        self.position = position
        self._mesh = mesh
        self._other = reordered(mesh, axes)
        self._axes = axes
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lsgd_jax-average"
        )
        self._pending: concurrent.futures.Future | None = None
        self._programs: dict[int, Any] = {}

    def _program(self, level: int, averager: Any) -> Any:
        if level not in self._programs:
            rep = P(self._axes)
            manual = frozenset(self._axes)
            names = frozenset(self._mesh.axis_names)
            kwargs: dict[str, Any] = {} if manual == names else {"axis_names": manual}

            def body(state):
                state = jax.tree.map(lambda x: x[0], state)
                state = _average_call.finish_deferred(averager, state, level)
                return jax.tree.map(lambda x: x[None], state)

            mapped = jax.shard_map(body, mesh=self._other, in_specs=rep, out_specs=rep, **kwargs)
            self._programs[level] = jax.jit(mapped)
        return self._programs[level]

    def _finish(self, state: ModelAveragerState, level: int) -> ModelAveragerState:
        out = self._program(level, state.averager)(on_mesh(state, self._other))
        return on_mesh(jax.block_until_ready(out), self._mesh)

    @staticmethod
    def events(state: ModelAveragerState, digit: int) -> tuple[bool, int]:
        """For the averager ``state`` in phase ``digit``: whether its delayed average
        lands, and the level of the one it starts (0: none)."""
        lands = int(digit) > state.averager.num_levels
        return lands, _phase.delayed_start(state, int(digit))

    def start(self, state: ModelAveragerState, level: int) -> None:
        """Takes the mean of the average ``state`` started (a state no step donates)."""
        if self._pending is not None:  # one in flight at a time (delay < period)
            self._pending.result()
        self._pending = self._executor.submit(self._finish, state, level)

    def start_from(self, opt_state: Any) -> None:
        """After a restore (or a state this step did not return): an average that
        started but was not taken yet is taken now, from a copy of its state."""
        state = _phase.branching_states(opt_state)[self.position]
        level = int(np.asarray(state.inflight_level.addressable_data(0)).reshape(-1)[0])
        if level:
            copy = jax.tree.map(lambda x: x.copy(), state)
            self.start(copy, level)

    def land(self, opt_state: Any, wait: bool) -> Any:
        """``opt_state`` with the mean written into the averager's state, if it is ready
        (or, with ``wait``, once it is); unchanged when nothing is in flight."""
        if self._pending is None or not (wait or self._pending.done()):
            return opt_state
        done = self._pending.result()
        self._pending = None
        leaves, treedef = jax.tree.flatten(opt_state, is_leaf=_is_state)
        states = [i for i, x in enumerate(leaves) if _is_state(x) and x.num_phases > 1]
        i = states[self.position]
        leaves[i] = leaves[i].replace(**{f: getattr(done, f) for f in _FIELDS})
        return jax.tree.unflatten(treedef, leaves)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _is_state(x: Any) -> bool:
    return isinstance(x, _phase.STATE_TYPES)
