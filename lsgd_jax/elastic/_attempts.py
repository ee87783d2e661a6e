"""Attempts under JAX's ``live_devices`` barrier, retried until one succeeds everywhere.

One attempt: the barrier's live set, the membership record (an epoch) agreed through
its leader (the lowest live process that holds the model), the state moved onto that
epoch's mesh (and joiners healed), then the work, waited for on every device. The
barrier at the attempt's end makes success all-or-nothing across the live processes;
a failed attempt is retried from the state before it.
:class:`lsgd_jax.elastic.ElasticLoop` runs its steps through this.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from lsgd_jax._core import _compat
from lsgd_jax.elastic import _heal, _membership, _process
from lsgd_jax.elastic._membership import Layout, View
from lsgd_jax.elastic._process import CoordinatorLostError, LeftBehindError, RunEndedError

logger = logging.getLogger("lsgd_jax.elastic")
AXES = ("node", "local")


def loop_axes(inside: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The loop's data axes: ``AXES``, or ``("node",)`` when a replica spans a process's
    devices (``inside == ("local",)``, FSDP over them).

    Example:
      >>> from lsgd_jax.elastic._attempts import loop_axes
      >>> loop_axes(), loop_axes(("local",))
      (('node', 'local'), ('node',))
    """
    return tuple(a for a in AXES if a not in inside)


def _end_process(label: str) -> None:
    os._exit(75)


class Watchdog:
    """Ends this process if one attempt's own work stalls for ``timeout_s`` (a stall that
    heartbeats do not reveal, e.g. a data loader stuck in Python): the others then see
    a dead process and go on, and a restarted one can join.

    Compiling is not a stall: while the armed thread traces, lowers or compiles a
    program (a first step, a new phase, a new membership's mesh), the clock is held at
    zero; it runs again once that ends (seen within a tick, a twentieth of the limit at
    most). So an attempt is ended when it runs ``timeout_s`` seconds without compiling,
    however long its compiles take.

    Args:
      timeout_s: the limit (None: never fires).
      on_stall: called with the attempt's label when it fires (default: this process
        ends with exit code 75).

    Example:
      >>> from lsgd_jax.elastic._attempts import Watchdog
      >>> dog = Watchdog(None)  # None: never fires
      >>> dog.arm("step 3"); dog.disarm()
    """

    def __init__(
        self, timeout_s: float | None, on_stall: Callable[[str], None] = _end_process
    ) -> None:
        self._timeout_s, self._on_stall = timeout_s, on_stall
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._label = ""
        self._thread = 0  # the armed thread
        self._closed = False
        if timeout_s is not None:
            # Compiles are seen by sampling: a tick is a small part of the limit.
            self._tick = min(0.5, timeout_s / 20)
            threading.Thread(target=self._watch, daemon=True, name="lsgd-watchdog").start()

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(self._tick)
            label = self._expired()
            if label is not None:
                logger.error(
                    "lsgd_jax.elastic: %s took more than stall_timeout_s=%s s; this process "
                    "ends so that the others can go on without it.",
                    label,
                    self._timeout_s,
                )
                self._on_stall(label)

    def _expired(self) -> str | None:
        """The label if the armed attempt stalled (then disarmed), else None; pushes the
        deadline while the armed thread compiles."""
        assert self._timeout_s is not None  # only the watching thread calls it
        with self._lock:
            if self._deadline is None:
                return None
            now = time.monotonic()
            if _compat.compiling(self._thread):
                self._deadline = max(self._deadline, now + self._timeout_s)
                return None
            if now <= self._deadline:
                return None
            self._deadline = None
            return self._label

    def arm(self, label: str) -> None:
        """Starts timing the calling thread's attempt."""
        if self._timeout_s is not None:
            with self._lock:
                self._label, self._thread = label, threading.get_ident()
                self._deadline = time.monotonic() + self._timeout_s

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def close(self) -> None:
        """Stops the watching thread (at its next tick)."""
        self.disarm()
        self._closed = True


def peer_gone(e: BaseException) -> bool:
    """Whether an attempt's error can mean that a peer is gone (then it is retried).

    ``live_devices`` says a process failed (``ProcessFailureError``); a collective or
    the coordination service's store failed or timed out (JAX's runtime errors). Any
    other error is deterministic (the user's loss, batch or state; a bug) and a retry
    would only repeat it.

    Example:
      >>> from lsgd_jax.elastic._attempts import peer_gone
      >>> peer_gone(ValueError("a bad batch"))
      False
    """
    from jax.experimental.multihost_utils import ProcessFailureError

    return isinstance(e, (ProcessFailureError, jax.errors.JaxRuntimeError))


def settle(tree: Any) -> Any:
    """Waits for every device's part of ``tree``; the first error after all are done.

    After a failed collective, a process's other devices may still be running the
    step (until their own collectives fail or time out); the next attempt must not
    start while they do, or their late messages reach a communicator in use.
    """
    error = None
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            try:
                shard.data.block_until_ready()
            except Exception as e:
                error = error or e
    if error is not None:
        raise error
    return tree


def first_line(e: BaseException) -> str:
    """``"Type: first line of the message"`` (at most 300 characters of it)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _live_members() -> tuple[tuple[int, int], ...]:
    """The barrier's live ``(process, incarnation)`` pairs (see :func:`check_members`)."""
    from jax.experimental import multihost_utils as mh

    incarnation = mh.live_devices.devices
    assert incarnation is not None  # set by entering the block
    members = tuple(sorted({(d.process_index, int(i)) for d, i in incarnation.items()}))
    return check_members(members, jax.process_index(), _process.external_coordinator())


def check_members(
    members: tuple[tuple[int, int], ...], me: int, external: bool
) -> tuple[tuple[int, int], ...]:
    """``members`` if this process can go on with them; else the error that says why.

    Raises:
      LeftBehindError: this process is not among them (the others declared it dead).
      CoordinatorLostError: process 0 hosted the coordination service and is gone.

    Example:
      >>> from lsgd_jax.elastic._attempts import check_members
      >>> check_members(((0, 1), (2, 1)), 2, external=False)
      ((0, 1), (2, 1))
    """
    live = {p for p, _ in members}
    if me not in live:
        raise LeftBehindError(
            f"lsgd_jax.elastic: process {me} is not among the live processes {sorted(live)}: "
            "the others declared it dead (stopped or cut off for longer than the heartbeat "
            "timeout) and went on without it. Restart this process; it then joins the "
            "running job."
        )
    if not external and 0 not in live:
        raise CoordinatorLostError(
            "lsgd_jax.elastic: process 0 (the coordination service's host) is "
            "gone; the run cannot continue. Restart the job (from a checkpoint)."
        )
    return members


def _log_change(step: int, before: View, view: View, rows: tuple[int, ...]) -> None:
    """Logs a new membership: its processes in the order of the mesh's rows."""
    logger.warning(
        "lsgd_jax.elastic: from step %d on, processes %s (epoch %d, a new device order): "
        "%s left, %s joined",
        step,
        list(rows),
        view.epoch,
        sorted(set(before.processes) - set(view.processes)) or "none",
        sorted(view.joining) or "none",
    )


def _restarted(restart: Any, view: View, layout: Layout) -> Any:
    """The state every member of a restart view (nobody held the model) starts from:
    ``restart.state`` at the view's step, over the view's mesh."""
    logger.warning(
        "lsgd_jax.elastic: no live process held the model (live: %s); all restart from "
        "step %d (%s) and run the steps since again.",
        list(view.processes),
        view.step,
        "the newest checkpoint" if view.step else "the fresh state",
    )
    return restart.state(layout.mesh, view.step)


def adopt(
    state: Any,
    step: int,
    view: View,
    layout: Layout,
    new_view: bool,
    fresh: Callable[[Any], tuple[Any, ...]],
    inside: tuple[str, ...] = (),
) -> tuple[Any, int]:
    """This process's state over the new mesh (healed if anyone joins), and its step.

    Also called on an unchanged membership for a state given from outside (which may
    sit on another mesh): it is only moved then; who joined was settled before.

    Args:
      state: ``(params, [model_state,] opt_state)`` over the last mesh (None: none).
      step: this process's step.
      view, layout: the membership and its layout.
      new_view: whether the membership changed.
      fresh: ``fresh(mesh)``, the state a joiner starts from before it is healed.
      inside: the FSDP axes inside a replica (``("local",)``: one replica a process).

    Returns:
      ``(state, step)`` over ``layout.mesh``.
    """
    me, axes = jax.process_index(), loop_axes(inside)
    joining = new_view and me in view.joining
    if joining or state is None:
        state, step = fresh(layout.mesh), view.step
    else:
        state = tuple(_heal.reshard(x, layout.mesh, axes, inside) for x in state)
        if new_view and step != view.step:
            raise RuntimeError(
                f"lsgd_jax.elastic: process {me} is at step {step} but the survivors "
                f"are at step {view.step}; this is a bug, please report it."
            )
    if new_view and view.joining:
        # Params and model state (if any) are healed alike: the live replicas' mean.
        *model, opt_state = state
        source = min(p for p in view.processes if p not in view.joining)
        healed = _heal.heal(tuple(model), opt_state, layout.mesh, axes, joining, me == source)
        state = (*healed[0], healed[1])
    return state, step


# Errors that end this process without being the user's (not posted for the others).
_NOT_THE_USERS = (CoordinatorLostError, LeftBehindError)


class Attempts:
    """Runs work in attempts until one succeeds on every live process.

    Args:
      fresh: ``fresh(mesh) -> (params, opt_state)`` (or ``(params, model_state,
        opt_state)``), a new state over a mesh (what a joining process starts from
        before it is healed).
      stall_timeout_s: the watchdog's limit on one attempt's own work, compiles not
        counted (None: never).
      max_failures: consecutive failed attempts after which :meth:`retrying` gives up.
      restart: when no live process holds the model: ``restart.step()``, the step to
        restart from (None: none), asked on the membership's leader; then every
        member's ``restart.state(mesh, step)``. None: no restart (the run ends with
        ``CoordinatorLostError``).
      shard_over: FSDP axes inside a replica (``("local",)``: one replica a process,
        sharded over its devices); none: one replica a device.

    Attributes:
      view: the membership of the last committed attempt (None before the first).
      layout: its layout.
      given: a state passed in from outside (a checkpoint, an earlier run) that the next
        attempt moves onto its mesh even if the membership did not change.
      records_started: whether a step was committed since the loop's run began (the
        first membership of a run is not a "change" to recover from).
      last_step: the run's ``num_steps`` while it trains (None otherwise): a process
        that (re)starts and is given a step at or past it has nothing to run.
      over: the step at which such a process found the run over (then it exits with
        status 0 after this attempt, whatever its outcome).
    """

    def __init__(
        self,
        fresh: Callable[[Any], tuple[Any, ...]],
        stall_timeout_s: float | None,
        max_failures: int,
        restart: Any = None,
        shard_over: tuple[str, ...] = (),
    ) -> None:
        self._fresh, self._max_failures, self.restart = fresh, max_failures, restart
        self._inside = shard_over
        self._membership = _membership.Membership(timeout_s=120.0)
        _membership.forget_own_gloo_keys({d.id for d in jax.local_devices()})
        _membership.forget_user_error(jax.process_index())
        self._watchdog = Watchdog(stall_timeout_s)
        self.view: View | None = None
        self.layout: Layout | None = None
        self.given: Any = None
        self.records_started = False
        self.last_step: int | None = None  # run's num_steps while it trains
        self.over: int | None = None  # set when this process arrived after the last step
        self._attempted: int | None = None  # the epoch the attempt running now agreed on
        self._failed: int | None = None  # the epoch of the last attempt, if it failed

    def _body(self, members, state, step: int, work: Callable[..., Any], label: str):
        """The attempt inside the barrier: agree, adopt, work. Returns ``(out, step, view,
        layout, changed)``. The watchdog times what follows the agreement: waiting for
        the membership's leader (bounded by the agreement's own timeout) is not a stall
        of this process."""
        me = jax.process_index()
        restart_step = self.restart.step if self.restart is not None else None
        view = self._membership.agree(
            members, step, me, self.view, failed=self._failed, restart_step=restart_step
        )
        self._attempted = view.epoch
        self._watchdog.arm(f"{label} (step {step})")
        changed = self.view is None or view.epoch != self.view.epoch
        if changed and self.view is not None:  # did one leave because of a user error?
            _membership.raise_user_error(sorted(set(self.view.processes) - set(view.processes)))
        layout = self.layout
        if changed or layout is None:
            layout = _membership.layout_for(view, bool(self._inside))
        if changed and view.restart:
            state, step = _restarted(self.restart, view, layout), view.step
        elif changed or self.given is not None:
            state, step = adopt(state, step, view, layout, changed, self._fresh, self._inside)
        if _process.newcomer() and self.last_step is not None and step >= self.last_step:
            # A (re)started process met the survivors after their last step (they are
            # at their consensus): it was healed with them, but has no step to run.
            self.over = step
            return None, step, view, layout, changed
        return settle(work(state, step, layout)), step, view, layout, changed

    def _attempt(self, state, step: int, work: Callable[..., Any], label: str):
        from jax.experimental import multihost_utils as mh

        # One barrier per attempt, at its end (live_devices caches the set it found
        # there for the next entry): a process that (re)starts has no cached set, so
        # its entry barrier meets the others' exit barrier, and from then on every
        # process runs the same attempts in the same phase. (Resetting the cache would
        # add an entry barrier that a newcomer's first barrier could pair with instead.)
        self._attempted = None
        with mh.live_devices(jax.devices()):
            members = _live_members()
            # The watchdog times the body only (from the agreement on): waiting in the
            # barrier for a peer's failure to be detected is not a stall of this process.
            try:
                out, step, view, layout, changed = self._body(members, state, step, work, label)
            except Exception as e:
                if not (peer_gone(e) or isinstance(e, (RunEndedError, _NOT_THE_USERS))):
                    # Before the barrier: the others read it once their attempt fails.
                    _membership.post_user_error(jax.process_index(), step, first_line(e))
                raise
            finally:
                self._watchdog.disarm()
        if changed and self.view is not None:
            _log_change(step, self.view, view, layout.processes)
        self.view, self.layout, self.given, self._failed = view, layout, None, None
        _process.note_committed()
        if changed:  # its joiners hold the model now (see _membership.leader)
            _membership.mark_committed(view.epoch)
        return out, step, changed

    def retrying(self, label: str, state, step: int, work: Callable[..., Any]):
        """Runs ``work(state, step, layout)`` in attempts until one succeeds everywhere.

        Args:
          label: what the work is, for logs and errors.
          state: ``(params, [model_state,] opt_state)`` over the last committed mesh
            (None: fresh).
          step: this process's step.
          work: the attempt's work; its outputs are waited for on every device.

        Returns:
          ``(outputs, step, recovery_s, failures)``: ``step`` may differ from the one
          given for a joining process; ``recovery_s`` is set when the attempt followed
          failures or a membership change.
        """
        failures: list[str] = []
        start = time.perf_counter()
        while True:
            try:
                out, new_step, changed = self._attempt(state, step, work, label)
            except Exception as e:
                if self.over is not None:
                    raise _process.run_over(jax.process_index(), self.over) from None
                if not peer_gone(e):  # the user's error (or the coordinator's loss): at once
                    raise
                # Its view's communicators may be broken: a retry gets a new epoch.
                self._failed = self._attempted
                if self._attempted is not None:  # before the retry's barrier: see agree
                    _membership.mark_failed(self._attempted)
                # A dead peer, a timed-out collective, a new member; or a peer that left
                # with an error of the user's (then this process stops too).
                me, n = jax.process_index(), jax.process_count()
                peers = self.view.processes if self.view is not None else range(n)
                _membership.raise_user_error([p for p in peers if p != me], e)
                failures.append(f"step {step}: {first_line(e)}")
                logger.warning("lsgd_jax.elastic: %s failed (%s); retrying.", label, failures[-1])
                if len(failures) >= self._max_failures:
                    raise RuntimeError(
                        f"lsgd_jax.elastic: {label} failed {len(failures)} times in a row "
                        f"(max_failures); the last: {failures[-1]}"
                    ) from e
                continue
            if self.over is not None:
                raise _process.run_over(jax.process_index(), self.over)
            disturbed = bool(failures) or (changed and self.records_started)
            recovery = time.perf_counter() - start if disturbed else None
            return out, new_step, recovery, tuple(failures)
