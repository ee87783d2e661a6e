"""Who is in an elastic run: the live processes, the epoch that names each membership,
and the device order (mesh) every process derives from it.

JAX's ``live_devices`` barrier gives every live process the same set of live processes
and their incarnations (a restarted process has a new one). A leader numbers each new
membership (an epoch) in the coordination service's key-value store, with the step the
survivors are at and who joins; every process reads that record, so a process that
just (re)started learns the epoch, the step and that it must receive the state. The
leader is the lowest live process that holds the model: one that was in the last
recorded membership and not joining in it, or any member of it once an attempt of it
committed (it has the survivors' state and step). So
no process is special: process 0 too may die and come back (with the coordination
service in a process of its own, ``lsgd_jax.elastic_coordinator``), and then it joins
like any other.

Why epochs name device orders: on CPU, gloo keys each communicator by the mesh's device
order. A restarted process cannot reuse the key its dead incarnation registered
("ALREADY_EXISTS"), and the survivors' cached communicator for that order still points
at the dead peer. So each epoch uses a device order no earlier epoch used: the epoch
number, written in a mixed radix, picks a permutation of the process rows and of each
process's devices (an order repeats only after ``n! * (d!)**n`` membership changes).
An attempt that failed with the membership unchanged (a collective timed out, a peer
paused for less than the heartbeat timeout) can leave those communicators broken on
every process: its retry gets a new epoch too, with the same members and no joiner.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from lsgd_jax.elastic._device_order import device_rows
from lsgd_jax.elastic._process import CoordinatorLostError, RunEndedError, run_over

PREFIX = "lsgd_jax/elastic"
logger = logging.getLogger("lsgd_jax.elastic")
_PATIENCE_S = 15.0  # a membership record takes milliseconds: log a longer wait


FINISHED = f"{PREFIX}/finished"


def mark_finished(step: int) -> None:
    """Records that the run reached ``step`` (its end): a process that (re)starts for a
    run of at most that many steps then exits instead of joining."""
    try:
        client().key_value_set(FINISHED, str(int(step)), allow_overwrite=True)
    except Exception:  # the service is gone: nobody can join anyway
        pass


def finished_step() -> int | None:
    """The step the run ended at (:func:`mark_finished`), or None while it goes on."""
    try:
        return int(client().key_value_try_get(FINISHED))
    except Exception:  # NOT_FOUND: not finished
        return None


def _error_key(process: int) -> str:
    return f"{PREFIX}/user_error/{process}"


def post_user_error(me: int, step: int, error: str) -> None:
    """Tells the others that this process ends the run at ``step`` with ``error`` (a
    deterministic error: the user's loss, batch or state), so that they stop too instead
    of going on without it."""
    try:
        record = json.dumps({"step": step, "error": error})
        client().key_value_set(_error_key(me), record, allow_overwrite=True)
    except Exception:  # the service is gone: the others end anyway
        pass


def forget_user_error(me: int) -> None:
    """Deletes what an earlier incarnation of this process posted (a restart fixed it)."""
    try:
        client().key_value_delete(_error_key(me))
    except Exception:  # nothing was posted
        pass


def raise_user_error(processes: Any, cause: BaseException | None = None) -> None:
    """RunEndedError if one of ``processes`` ended the run with a user error; else None.

    Args:
      processes: the processes to ask about (e.g. those that just left the run).
      cause: the error this process saw meanwhile (chained).
    """
    c = client()
    for p in processes:
        try:
            text = c.key_value_try_get(_error_key(p))
        except Exception:  # none posted (NOT_FOUND), or the service is gone
            continue
        d = json.loads(text)
        raise RunEndedError(
            f"lsgd_jax.elastic: process {p} ended the run at step {d['step']} with "
            f"{d['error']} (an error in the user's code or arguments, not a failure of a "
            "process; that process's traceback shows it); every process stops. Fix it and "
            "start the job again."
        ) from cause


def client() -> Any:
    """The ``jax.distributed`` client; a clear error when JAX is not initialized."""
    from lsgd_jax._core import _compat

    c = _compat.distributed_client()
    if c is None:
        raise RuntimeError(
            "lsgd_jax.elastic: jax.distributed is not initialized; call "
            "lsgd_jax.elastic.initialize(coordinator_address, num_processes, process_id) "
            "before building the loop."
        )
    return c


@dataclasses.dataclass(frozen=True)
class View:
    """One membership, as its leader recorded it.

    Attributes:
      members: ``(process, incarnation)`` pairs, by process.
      epoch: this membership's number (0: the first).
      step: the step the survivors were about to run when it began.
      joining: processes that must receive the state (new or back).
      restart: no live process held the model: every member restores the state at
        ``step`` (the newest finalized checkpoint, or the fresh state at step 0) and
        the steps since are run again (``step`` -1: there was nothing to restart
        from, and the run ends).
    """

    members: tuple[tuple[int, int], ...]
    epoch: int
    step: int
    joining: tuple[int, ...]
    restart: bool = False

    @property
    def processes(self) -> tuple[int, ...]:
        return tuple(p for p, _ in self.members)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> View:
        d = json.loads(text)
        return cls(
            tuple((int(p), int(i)) for p, i in d["members"]),
            int(d["epoch"]),
            int(d["step"]),
            tuple(int(p) for p in d["joining"]),
            bool(d.get("restart", False)),
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process sits in the current membership.

    Attributes:
      processes: the live processes, in the order of the mesh's rows (nodes).
      row: this process's row (its position in ``processes``).
      devices_per_process: devices of each process: its replicas, or with the loop's
        ``step_options={"fsdp_axes": "local"}`` the devices its one replica spans.
      epoch: the membership's number (0: the first; +1 on every change).
      mesh: the mesh of this membership, axes ``("node", "local")``.
      replica_spans_process: whether each process is one replica over its devices
        (``fsdp_axes="local"``).
    """

    processes: tuple[int, ...]
    row: int
    devices_per_process: int
    epoch: int
    mesh: Mesh
    replica_spans_process: bool = False

    @property
    def num_replicas(self) -> int:
        """How many live replicas there are (one a device, or one a process whose devices
        one replica spans)."""
        per_process = 1 if self.replica_spans_process else self.devices_per_process
        return len(self.processes) * per_process


def layout_for(view: View, replica_spans_process: bool = False) -> Layout:
    """This process's :class:`Layout` in ``view``: the mesh of the epoch's device order."""
    import jax
    import numpy as np

    by_process: dict[int, list[Any]] = {p: [] for p in view.processes}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        if d.process_index in by_process:
            by_process[d.process_index].append(d)
    rows = device_rows(view.epoch, by_process)
    mesh = Mesh(np.array(rows, dtype=object), ("node", "local"))
    me = jax.process_index()
    row = next(i for i, r in enumerate(rows) if r[0].process_index == me)
    processes = tuple(r[0].process_index for r in rows)
    return Layout(processes, row, len(rows[0]), view.epoch, mesh, replica_spans_process)


def _key(members: tuple[tuple[int, int], ...]) -> str:
    return f"{PREFIX}/view/" + ",".join(f"{p}:{i}" for p, i in members)


LATEST = f"{PREFIX}/latest"


def _latest(c: Any) -> View | None:
    try:
        return View.from_json(c.key_value_try_get(LATEST))
    except Exception:  # NOT_FOUND: no membership recorded yet
        return None


def leader(
    members: tuple[tuple[int, int], ...], latest: View | None, committed: int | None = None
) -> int | None:
    """The process that records the next view: the lowest live one that holds the model;
    the lowest live one before any view; None when no live process holds it.

    A live process holds the model when it is in ``latest`` with the same incarnation
    and either was not joining in it or an attempt of ``latest`` committed (``committed``
    is its epoch: a joiner healed then).

    Args:
      members: the live ``(process, incarnation)`` pairs.
      latest: the last recorded view (None: none yet).
      committed: the epoch of the last view an attempt committed (None: none yet).

    Returns:
      The leader's process index, or None.

    Example:
      >>> from lsgd_jax.elastic._membership import View, leader
      >>> latest = View(((0, 5), (1, 6), (2, 7)), 4, 30, (0,))  # process 0 was joining
      >>> leader(((0, 5), (1, 6)), latest), leader(((0, 9), (2, 7)), None)
      (1, 0)
      >>> leader(((0, 5),), latest), leader(((0, 5),), latest, committed=4)
      (None, 0)
    """
    if latest is None:
        return min(p for p, _ in members)
    healed = committed is not None and committed >= latest.epoch
    holders = [
        p for p, i in members if (p, i) in latest.members and (healed or p not in latest.joining)
    ]
    return min(holders) if holders else None


COMMITTED = f"{PREFIX}/committed"


def mark_committed(epoch: int) -> None:
    """Records that an attempt of the view ``epoch`` committed (its joiners hold the
    model now). Each process writes it after its first committed attempt of a view,
    before its next attempt, so a sole survivor reads its own mark."""
    try:
        client().key_value_set(COMMITTED, str(int(epoch)), allow_overwrite=True)
    except Exception:  # the service is gone: nobody can lead anyway
        pass


FAILED = f"{PREFIX}/failed"


def mark_failed(epoch: int) -> None:
    """Records that an attempt of the view ``epoch`` failed on this process after it
    agreed on that view. Written before the retry's barrier, so every process reads it
    after: a process whose own attempt failed before it agreed (in the barrier) still
    knows that the view's communicators may be broken, and the leader and the others
    agree on whether the retry is a new epoch."""
    try:
        client().key_value_set(FAILED, str(int(epoch)), allow_overwrite=True)
    except Exception:  # the service is gone: nobody can lead anyway
        pass


def _failed_mark(c: Any) -> int | None:
    try:
        return int(c.key_value_try_get(FAILED))
    except Exception:  # NOT_FOUND: no attempt failed yet
        return None


def _committed(c: Any) -> int | None:
    try:
        return int(c.key_value_try_get(COMMITTED))
    except Exception:  # NOT_FOUND: no attempt committed yet
        return None


def lost(members: tuple[tuple[int, int], ...], latest: View | None) -> CoordinatorLostError:
    """The error of a run no live process holds the model of, with nothing to restart
    from."""
    return CoordinatorLostError(
        f"lsgd_jax.elastic: every process that held the model is gone (live now: "
        f"{[p for p, _ in members]}, none of them in the last membership "
        f"{latest.processes if latest else ()}) and there is no checkpoint to restart "
        "from; the run cannot go on. Pass checkpoint_dir= and checkpoint_every= to the "
        "loop, and restart the job."
    )


class Membership:
    """Agrees on the view of each attempt (call :meth:`agree` inside ``live_devices``)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_ms = int(timeout_s * 1000)

    def agree(
        self,
        members: tuple[tuple[int, int], ...],
        step: int,
        me: int,
        committed: View | None,
        failed: int | None = None,
        restart_step: Callable[[], int | None] | None = None,
    ) -> View:
        """The view for these live members: the leader (:func:`leader`) records it when
        the membership changed, or when the last attempt failed with it unchanged;
        every process reads it.

        Args:
          members: ``(process, incarnation)`` of every live process, by process (the
            same on every process: ``live_devices`` is a barrier).
          step: this process's next step (only the leader's is recorded).
          me: this process's index.
          committed: the view of this process's last successful attempt (None at
            first). The leader's says who joins: whoever was not in it (an attempt that
            failed healed no one).
          failed: the epoch of this process's last attempt if it failed (None if it
            succeeded, or failed before it agreed on a view). A view of that epoch with
            the same members is not used again: its communicators may be broken (a
            timed-out collective), so its retry gets the next epoch, a new device order.
          restart_step: called on the lowest live process when no live process holds
            the model and the run is not over: the step to restart every member from
            (the newest finalized checkpoint; 0 for the fresh state), or None when
            there is none. None (the argument): no restart.

        Returns:
          The agreed :class:`View`.

        Raises:
          RunOver: no live process holds the model and the run is over.
          CoordinatorLostError: no live process holds the model, the run is not over
            and there is nothing to restart from.
        """
        c = client()
        key = _key(members)
        latest = _latest(c)
        # A retry of the same members gets a new epoch if any process's attempt of the
        # latest view failed after agreeing on it (its own ``failed``, or the mark one
        # of them left before this barrier), the same answer on every process.
        retry = (
            latest is not None
            and latest.members == members
            and latest.epoch in (failed, _failed_mark(c))
        )
        if latest is not None and latest.members == members and not retry:
            if latest.restart and latest.step < 0:  # nothing to restart from (below)
                raise lost(members, latest)
            return latest  # unchanged (the usual step): one read of the store
        lead = leader(members, latest, _committed(c))
        restart = lead is None
        if restart:
            end = finished_step()
            if end is not None:
                raise run_over(me, end)
            lead = min(p for p, _ in members)
        if restart and restart_step is None:
            raise lost(members, latest)
        if me == lead and restart:
            start = restart_step()  # type: ignore[misc]
            everyone = tuple(p for p, _ in members)  # none holds it until one commits
            view = View(members, 0, -1 if start is None else start, everyone, True)
            view = self._record(c, key, latest, retry, view)
        elif me == lead:
            before = set(committed.members) if committed is not None else set(members)
            joining = tuple(p for p, i in members if (p, i) not in before)
            return self._record(c, key, latest, retry, View(members, 0, step, joining))
        else:
            view = self._read(c, key, latest.epoch if retry and latest is not None else None)
        if view.restart and view.step < 0:  # the leader found nothing to restart from
            raise lost(members, latest)
        return view

    @staticmethod
    def _record(c: Any, key: str, latest: View | None, retry: bool, view: View) -> View:
        """The leader records ``view`` (its epoch: the next one) as the latest and
        under its members' key."""
        if latest is not None and not retry:
            # The old record goes first: if that membership comes back later, its
            # readers wait for the new record instead of reading a stale epoch.
            c.key_value_delete(_key(latest.members))
        view = dataclasses.replace(view, epoch=0 if latest is None else latest.epoch + 1)
        c.key_value_set(LATEST, view.to_json(), allow_overwrite=True)
        c.key_value_set(key, view.to_json(), allow_overwrite=True)
        return view

    def _read(self, c: Any, key: str, after: int | None) -> View:
        """The view recorded under ``key``; with ``after``, one of a later epoch (the
        leader's record for a retry replaces the failed one's under the same key)."""
        deadline = time.monotonic() + self._timeout_ms / 1000
        patience = time.monotonic() + _PATIENCE_S  # then say what this process waits for
        warned = False
        while True:
            now = time.monotonic()
            until = deadline if warned else min(deadline, patience)
            left_ms = max(1, int((until - now) * 1000))
            try:
                view = View.from_json(c.blocking_key_value_get(key, left_ms))
            except Exception:  # a timeout; or the service is gone (then raised again)
                if warned or time.monotonic() >= deadline:
                    raise
                logger.warning(
                    "lsgd_jax.elastic: process %d waits for the membership record %s "
                    "(%s) from its leader, %.0f s so far (at most %.0f s)",
                    jax.process_index(), key, f"after epoch {after}" if after is not None
                    else "any epoch", _PATIENCE_S, self._timeout_ms / 1000,
                )  # fmt: skip
                warned = True
                continue
            if after is None or view.epoch > after:
                return view
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"lsgd_jax.elastic: no new membership record after the failed attempt "
                    f"of epoch {after} within {self._timeout_ms / 1000:g} s (its leader did "
                    "not record one); this is a bug, please report it."
                )
            time.sleep(0.01)


def forget_global_topology() -> list[str]:
    """Deletes the device topology process 0 published when the backend first started.

    Process 0 writes the job's global topology once, and may not overwrite it; when the
    coordination service outlives process 0 (``lsgd_jax.elastic_coordinator``), a
    restarted process 0 would fail to start its backend (``ALREADY_EXISTS: key
    cpu:global_topology/cpu``). The others read it only at their start, and the devices
    do not change, so it can go. Call before the backend starts.

    Returns:
      The deleted keys.
    """
    c, gone = client(), []
    for platform in ("cpu", "cuda", "gpu", "rocm"):
        key = f"{platform}:global_topology/{platform}"
        try:
            c.key_value_try_get_bytes(key)
        except Exception:  # nothing published for this platform
            continue
        c.key_value_delete(key)
        gone.append(key)
    return gone


def forget_own_gloo_keys(device_ids: set[int]) -> list[str]:
    """Deletes the gloo rendezvous keys of groups made only of this process's devices.

    A restarted process cannot register a communicator whose key its dead incarnation
    left in the coordination service's store (``ALREADY_EXISTS``). Groups of its own
    devices alone (the node-local mean) are used by no other process, so their keys can
    go; groups with other processes' devices get new keys from the epoch's new order.

    Args:
      device_ids: the ids of this process's devices.

    Returns:
      The deleted key prefixes.
    """
    c, prefix = client(), "cpu:gloo/"
    gone: list[str] = []
    try:
        entries = c.key_value_dir_get_bytes(prefix)
    except Exception:  # no such directory: nothing was registered yet
        return gone
    for key, _ in entries:
        group = key[len(prefix) :].rsplit("/", 1)[0]
        try:
            ids = {int(x) for x in group.split(",")}
        except ValueError:
            continue
        if ids <= device_ids and prefix + group not in gone:
            c.key_value_delete(prefix + group)
            gone.append(prefix + group)
    return gone
