"""lsgd_jax.elastic._device_order: each membership epoch's order of the processes and of
their devices (a new order for every epoch, until all of them were used)."""

from __future__ import annotations

import itertools
import math

import pytest

from lsgd_jax.elastic import _device_order


class FakeDevice:
    def __init__(self, id, process_index):
        self.id, self.process_index = id, process_index

    def __repr__(self):
        return f"d{self.id}"


def fake_devices(n_proc, d):
    return {p: [FakeDevice(p * 1000 + k, p) for k in range(d)] for p in range(n_proc)}


@pytest.mark.parametrize("n_proc,d", [(1, 1), (2, 2), (3, 2), (2, 3)])
def test_every_epoch_until_the_cycle_has_its_own_device_order(n_proc, d):
    devices = fake_devices(n_proc, d)
    total = math.factorial(n_proc) * math.factorial(d) ** n_proc
    orders = []
    for epoch in range(total + 1):
        rows = _device_order.device_rows(epoch, devices)
        # Each row is one whole process, with all of its devices.
        assert sorted(r[0].process_index for r in rows) == list(range(n_proc))
        for r in rows:
            assert sorted(x.id for x in r) == [x.id for x in devices[r[0].process_index]]
            assert {x.process_index for x in r} == {r[0].process_index}
        orders.append(tuple(x.id for r in rows for x in r))
    assert orders[0] == tuple(x.id for p in range(n_proc) for x in devices[p])  # as given
    assert len(set(orders[:total])) == total  # no order repeats within a cycle
    assert orders[total] == orders[0]


def test_the_permutation_numbering_matches_itertools():
    items = list("abcd")
    for i, perm in enumerate(itertools.permutations(items)):
        assert _device_order._permutation(i, items) == list(perm)
