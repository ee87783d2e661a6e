"""lsgd_jax.elastic._membership: the membership record (View, Layout), which process
leads a change, and how the processes agree on each epoch through the coordination
service's key-value store (a fake store here): a failed attempt's new epoch, joiners, and
a restart from a checkpoint when no live process holds the model."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import lsgd_jax
from lsgd_jax.elastic import _device_order, _membership

AXES = ("node", "local")


def test_a_view_survives_its_json_round_trip():
    v = _membership.View(((0, 11), (2, 40)), 3, 57, (2,))
    assert _membership.View.from_json(v.to_json()) == v
    assert v.processes == (0, 2)


def test_the_leader_is_the_lowest_live_process_that_holds_the_model():
    View = _membership.View
    # Before any view: the lowest live process, whichever it is.
    assert _membership.leader(((1, 7), (2, 8)), None) == 1
    latest = View(((0, 5), (1, 6), (2, 7)), 3, 20, ())
    assert _membership.leader(((0, 5), (1, 6), (2, 7)), latest) == 0
    assert _membership.leader(((1, 6), (2, 7)), latest) == 1  # process 0 died
    # Process 0 came back (a new incarnation): it joins, it does not lead.
    assert _membership.leader(((0, 9), (1, 6), (2, 7)), latest) == 1
    back = View(((0, 9), (1, 6), (2, 7)), 4, 26, (0,))
    assert _membership.leader(((0, 9), (2, 7)), back) == 2  # joining in the last one
    assert _membership.leader(((0, 9),), back) is None  # nobody holds the model
    # ... unless an attempt of that view committed: process 0 was healed then (seen in
    # the soak: the sole survivor had joined in the last view, and was refused).
    assert _membership.leader(((0, 9),), back, committed=4) == 0
    assert _membership.leader(((0, 9),), back, committed=3) is None  # an older commit


class FakeStore:
    """The coordination service's key-value store, as ``Membership`` uses it."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise KeyError(key)
        return self.kv[key]

    def key_value_delete(self, key):
        self.kv.pop(key, None)

    def blocking_key_value_get(self, key, timeout_ms):
        return self.key_value_try_get(key)


def test_a_failed_attempt_with_the_same_members_gets_a_new_epoch(monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(_membership, "client", lambda: store)
    m = _membership.Membership(timeout_s=1.0)
    members = ((0, 5), (1, 6), (2, 7))
    first = m.agree(members, 0, 0, None)
    assert (first.epoch, first.joining) == (0, ())
    assert m.agree(members, 3, 1, first) == first  # unchanged: no new record
    # Step 3's attempt of epoch 0 failed everywhere (a collective timed out): a process
    # that is not the leader reads the old record and waits for the leader's new one.
    with pytest.raises(RuntimeError, match="no new membership record after the failed attempt"):
        m.agree(members, 3, 1, first, failed=0)
    retry = m.agree(members, 3, 0, first, failed=0)  # the leader records it
    assert (retry.members, retry.epoch, retry.step, retry.joining) == (members, 1, 3, ())
    assert m.agree(members, 3, 1, first, failed=0) == retry  # now the others read it
    assert m.agree(members, 3, 2, first, failed=None) == retry
    devices = {p: [f"{p}a", f"{p}b"] for p in range(3)}
    assert _device_order.device_rows(1, devices) != _device_order.device_rows(0, devices)
    # A failure of an older epoch does not bump the current one again.
    assert m.agree(members, 3, 0, retry, failed=0) == retry
    # A failure only some processes saw after agreeing: the leader's own attempt failed
    # before it agreed (in the barrier), process 2's after. Process 2's mark, written
    # before the retry's barrier, makes the leader record a new epoch too (before, it
    # returned the old view and process 2 waited for a new one: 120 s, then an error).
    _membership.mark_failed(1)
    again = m.agree(members, 3, 0, retry, failed=None)
    assert (again.epoch, again.members) == (2, members)
    assert m.agree(members, 3, 2, retry, failed=1) == again
    assert m.agree(members, 3, 1, retry, failed=None) == again  # the third reads it too
    store.kv[_membership.FAILED] = "-1"  # (the rest of this test knows no failure)
    retry = again
    # The committed mark: after process 2 restarts and joins at epoch 2, which commits,
    # it holds the model even if it is the only one left.
    back = ((0, 5), (1, 6), (2, 8))
    joined = m.agree(back, 5, 0, retry)
    assert (joined.epoch, joined.joining) == (3, (2,))
    _membership.mark_committed(3)
    alone = m.agree(((2, 8),), 6, 2, joined)
    assert (alone.epoch, alone.joining, alone.processes) == (4, (), (2,))


def test_when_no_live_process_holds_the_model_every_one_restarts_from_a_checkpoint(monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(_membership, "client", lambda: store)
    m = _membership.Membership(timeout_s=1.0)
    # Process 0 held the model alone; process 1 (restarted) was joining at epoch 4 when 0
    # died: the live process 1 holds nothing (seen in the soak).
    joined = m.agree(((0, 5),), 30, 0, None)
    store.kv[_membership.LATEST] = _membership.View(((0, 5), (1, 9)), 4, 31, (1,)).to_json()
    asked = []

    def newest():
        asked.append(True)
        return 25

    # Without a way to restart: the run cannot go on, on every process.
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match="no checkpoint to restart"):
        m.agree(((1, 9),), 0, 1, None)
    view = m.agree(((1, 9),), 0, 1, None, restart_step=newest)
    assert asked and (view.restart, view.step, view.epoch, view.joining) == (True, 25, 5, (1,))
    assert _membership.View.from_json(view.to_json()) == view
    # Its attempt failed (another death): nobody holds the model yet, so the retry
    # restarts again, in a new epoch.
    again = m.agree(((1, 9),), 25, 1, None, failed=5, restart_step=newest)
    assert (again.restart, again.step, again.epoch) == (True, 25, 6)
    # Once an attempt of it committed, its members hold the model: process 0, back, joins.
    _membership.mark_committed(6)
    back = m.agree(((0, 12), (1, 9)), 27, 1, again, restart_step=newest)
    assert (back.restart, back.step, back.joining, back.epoch) == (False, 27, (0,), 7)
    # Nothing to restart from: the leader records so, and every process raises.
    store.kv[_membership.LATEST] = joined.to_json()
    members = ((1, 9), (2, 3))
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match=r"live now: \[1, 2\]"):
        m.agree(members, 0, 1, None, restart_step=lambda: None)
    with pytest.raises(lsgd_jax.elastic.CoordinatorLostError, match="no checkpoint to restart"):
        m.agree(members, 0, 2, None, restart_step=lambda: 7)  # not asked: not the leader


def test_a_layout_counts_a_process_as_one_replica_when_the_replica_spans_it():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), AXES)
    assert _membership.Layout((0, 1), 0, 4, 0, mesh).num_replicas == 8
    assert _membership.Layout((0, 1), 0, 4, 0, mesh, True).num_replicas == 2
