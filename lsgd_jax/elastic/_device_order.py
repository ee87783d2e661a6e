"""The device order of each membership (epoch): a mesh no earlier epoch used, since
gloo keys its communicators by the ordered devices.
"""

from __future__ import annotations

import math
from typing import Any


def _permutation(index: int, items: list[Any]) -> list[Any]:
    """The ``index``-th permutation of ``items`` (factorial number system; 0: as is).

    Example:
      >>> from lsgd_jax.elastic._device_order import _permutation
      >>> [_permutation(i, [1, 2, 3]) for i in range(3)]
      [[1, 2, 3], [1, 3, 2], [2, 1, 3]]
    """
    items, out = list(items), []
    for k in range(len(items), 0, -1):
        f = math.factorial(k - 1)
        out.append(items.pop(index // f))
        index %= f
    return out


def device_rows(epoch: int, devices_by_process: dict[int, list[Any]]) -> list[list[Any]]:
    """The mesh rows (one per process) of an epoch: a device order no other epoch uses.

    Every device group of the mesh (a process's devices, one device of each process)
    gets its own gloo communicator, keyed by its ordered devices, and a failed attempt
    can leave one dirty. So consecutive epochs change every process's local order
    (the lowest digit, shared by all processes) before the order of the rows, and then
    the per-process offsets: all ``n! * (d!)**n`` orders come before one repeats.

    Args:
      epoch: the membership's number.
      devices_by_process: each live process's devices, in their usual order.

    Returns:
      One list of devices per live process; epoch 0 keeps every order as given.

    Example:
      >>> from lsgd_jax.elastic._device_order import device_rows
      >>> devices = {0: ["a", "b"], 1: ["c", "d"]}
      >>> device_rows(0, devices), device_rows(1, devices), device_rows(2, devices)
      ([['a', 'b'], ['c', 'd']], [['b', 'a'], ['d', 'c']], [['c', 'd'], ['a', 'b']])
    """
    procs = sorted(devices_by_process)
    n, fd = len(procs), math.factorial(len(devices_by_process[procs[0]]))
    index = epoch % (math.factorial(n) * fd**n)
    index, shared = divmod(index, fd)
    index, rows_digit = divmod(index, math.factorial(n))
    rows = []
    for i, p in enumerate(_permutation(rows_digit, procs)):
        offset = 0
        if i > 0:
            index, offset = divmod(index, fd)
        rows.append(_permutation((shared + offset) % fd, list(devices_by_process[p])))
    return rows
