"""The link between nodes, measured: timed all-reduces over the node axis, fitted."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from lsgd_jax import report, step
from lsgd_jax._core import _validate

# float32 values per device: one value (the latency a small collective such as a loss's
# mean waits), then from 1,024 by 8x until one takes longer than ``max_s`` (so a slow
# link is probed in seconds, a fast one to 16 MiB)
SIZES = (1, 1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22)
_TREE_S = 10.0  # about the seconds the timed runs of a ``like`` tree may take


@dataclasses.dataclass(frozen=True)
class Link:
    """The link between nodes: ``seconds = latency_s + link_bytes / bytes_per_s`` for
    one collective that puts ``link_bytes`` on it (every device together, as
    ``Ledger.link_per_step`` counts them).

    Example:
      >>> from lsgd_jax.planner import Link
      >>> Link(bytes_per_s=12.5e6, latency_s=0.001).seconds(2.5e6, collectives=2)
      0.202
    """

    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        rate = _validate.real_number(self.bytes_per_s, "Link: bytes_per_s", "12.5e6")
        latency = _validate.real_number(self.latency_s, "Link: latency_s", "0.001")
        if rate <= 0 or latency < 0:
            raise ValueError(
                f"Link: bytes_per_s must be > 0 and latency_s >= 0, got {rate} and "
                f"{latency}; e.g. Link(bytes_per_s=12.5e6, latency_s=0.001) for 100 Mbit/s."
            )
        object.__setattr__(self, "bytes_per_s", rate)
        object.__setattr__(self, "latency_s", latency)

    def seconds(self, link_bytes: float, collectives: int = 1) -> float:
        """The time of ``collectives`` collectives that put ``link_bytes`` on the link."""
        collectives = _validate.nonnegative_int(collectives, "Link.seconds: collectives")
        if link_bytes < 0 or collectives < 0:
            raise ValueError(
                f"Link.seconds: link_bytes and collectives count what a step sends, so "
                f"they are >= 0; got {link_bytes} and {collectives}."
            )
        return collectives * self.latency_s + link_bytes / self.bytes_per_s


def fit(link_bytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """The :class:`Link` whose line ``latency + bytes / bandwidth`` fits the timings
    (least squares on the relative error, so the small sizes that show the latency
    count as much as the large ones that show the rate; a latency below 0 reads as 0).

    Example:
      >>> from lsgd_jax.planner import fit
      >>> link = fit([1e3, 1e6, 4e6], [0.001 + b / 1e8 for b in (1e3, 1e6, 4e6)])
      >>> round(link.bytes_per_s), round(link.latency_s, 6)
      (100000000, 0.001)
    """
    x, y = np.asarray(link_bytes, float), np.asarray(seconds, float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"fit: one time per size, got {x.shape} sizes and {y.shape} times.")
    if not (np.isfinite(x).all() and (x >= 0).all()):
        raise ValueError(f"fit: the sizes are bytes, finite and >= 0; got {x.tolist()}.")
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError(f"fit needs two or more different sizes, got link_bytes={x.tolist()}.")
    if not (np.isfinite(y).all() and (y > 0).all()):
        raise ValueError(f"fit: the times must be positive and finite, got {y.tolist()}.")
    slope, intercept = np.polyfit(x, y, 1, w=1 / y)
    if slope <= 0:
        raise ValueError(
            "the timings do not grow with the bytes (a link this fast cannot be told from "
            f"the noise; got seconds={y.tolist()} for link_bytes={x.tolist()}): time larger sizes."
        )
    return Link(bytes_per_s=float(1 / slope), latency_s=float(max(intercept, 0.0)))


def measure_link(
    mesh: Mesh,
    *,
    node_axis: str = "node",
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    max_s: float = 0.3,
    clock: Callable[[], float] = time.perf_counter,
    axes: Sequence[str] | None = None,
    like: Any = None,
) -> tuple[Link, list[dict[str, Any]]]:
    """Times an all-reduce over ``node_axis`` of each size and fits a :class:`Link`.

    Every process of the mesh must call it (the all-reduces are collectives). Each
    program is compiled once, run once to warm up, then timed ``repeats`` times (the
    median counts, the largest over the processes, so that every process fits the same
    link); its bytes on the link are read off the compiled program as the ledger reads
    a step's.

    Args:
      mesh: the training mesh (its ``node_axis`` spans the nodes).
      node_axis: the mesh axis across nodes.
      sizes: float32 values per device of each all-reduce, smallest first.
      repeats: timed runs of each size.
      max_s: the larger sizes are left out once a run takes longer than this (at least
        two sizes are timed); the processes agree on it.
      clock: a monotonic clock, in seconds.
      axes: the all-reduce's mesh axes; None: ``(node_axis,)`` (one device of each node
        in a group); all of the mesh's: one flat group over every device, as a flat
        gradient mean.
      like: a tree (the model's params): also time one all-reduce of arrays of its
        leaves' sizes together, as a gradient mean sends them (several operands may
        each wait the link; timed fewer times when it takes seconds).

    Returns:
      ``(link, rows)``: the fit, and per size ``{"values", "link_bytes", "seconds"}``.

    Raises:
      ValueError: ``node_axis`` is not an axis of ``mesh``, or the fit failed.

    Example:
      >>> import lsgd_jax
      >>> from lsgd_jax.planner import measure_link
      >>> link, rows = measure_link(lsgd_jax.make_mesh(2, 4), sizes=(1 << 8, 1 << 20))
      >>> [r["link_bytes"] for r in rows]  # a ring's 2 hops across, for 4 groups
      [8192, 33554432]
    """
    axes, sizes, repeats, max_s = _checked(mesh, node_axis, sizes, repeats, max_s, axes, like)
    # the probe's shard_map wants Auto axes (jax.make_mesh's default is Explicit)
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    spec = P(tuple(mesh.axis_names))
    inner = tuple(a for a in mesh.axis_names if a != node_axis)
    node_of = step.mesh_nodes(mesh, inner)

    def timed(values: list[int], repeats: int, tree: bool = False) -> dict[str, Any]:
        """An all-reduce of one array of each of ``values`` floats a device, timed."""
        program = jax.jit(
            jax.shard_map(lambda x: lax.psum(x, axes), mesh=mesh, in_specs=spec, out_specs=spec)
        )
        x = [jnp.ones((mesh.devices.size * n,), jnp.float32) for n in values]
        compiled = program.lower(x).compile()
        collectives = report.communication_report(program, x, mesh=mesh)
        link_bytes = sum(step.link_bytes(c, node_of) for c in collectives)
        if not tree:
            jax.block_until_ready(compiled(x))
        else:  # a tree whose all-reduce is slow (a large model, a slow link) is timed less
            start = clock()
            jax.block_until_ready(compiled(x))
            warm = slowest(clock() - start)
            repeats = min(repeats, max(1, int(_TREE_S / max(warm, 1e-9))))
        times = []
        for _ in range(repeats):
            start = clock()
            jax.block_until_ready(compiled(x))
            times.append(clock() - start)
        seconds = slowest(statistics.median(times))  # every process fits the same link
        return {"values": sum(values), "link_bytes": link_bytes, "seconds": seconds}

    tree = None if like is None else _float_sizes(like)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        rows.append(timed([int(n)], repeats))
        if len(rows) >= 2 and rows[-1]["seconds"] > max_s:
            break
    if tree is not None:
        rows.append(timed(tree, repeats, tree=True))
        rows.sort(key=lambda r: r["link_bytes"])
    return fit([r["link_bytes"] for r in rows], [r["seconds"] for r in rows]), rows


def _checked(
    mesh: Mesh, node_axis: str, sizes: Any, repeats: Any, max_s: Any, axes: Any, like: Any
) -> tuple[tuple[str, ...], list[int], int, float]:
    """``measure_link``'s arguments, checked: ``(axes, sizes, repeats, max_s)``."""
    if node_axis not in mesh.axis_names:
        raise ValueError(
            f"measure_link: node_axis={node_axis!r} is not an axis of the mesh "
            f"{tuple(mesh.axis_names)}; pass the axis that spans the nodes."
        )
    if mesh.shape[node_axis] < 2:
        raise ValueError(
            f"measure_link: the mesh has one node along {node_axis!r}, so nothing crosses "
            "nodes and there is no link to measure; plan for the mesh of the real job."
        )
    repeats = _validate.positive_int(repeats, "measure_link: repeats")
    sizes = [_validate.positive_int(n, "measure_link: sizes") for n in sizes]
    if sizes != sorted(set(sizes)) or len(sizes) < (1 if like is not None else 2):
        raise ValueError(
            f"measure_link: sizes={sizes} must be two or more different sizes, smallest "
            "first (one is enough with like=), e.g. (1, 1024, 8192)."
        )
    max_s = _validate.real_number(max_s, "measure_link: max_s", "0.3")
    if not max_s > 0:
        raise ValueError(
            f"measure_link: max_s is the seconds a probe run may take before the sizes stop "
            f"growing, > 0; got {max_s}. Use e.g. 0.3."
        )
    axes = (node_axis,) if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    if (
        not axes
        or len(set(axes)) != len(axes)
        or not set(axes) <= set(mesh.axis_names)
        or node_axis not in axes
    ):
        raise ValueError(
            f"measure_link: axes={axes!r} must be distinct axes of the mesh "
            f"{tuple(mesh.axis_names)} that include the node axis {node_axis!r}, e.g. "
            f"({node_axis!r},) or {tuple(mesh.axis_names)}."
        )
    return axes, sizes, repeats, max_s


def _float_sizes(like: Any) -> list[int]:
    """The sizes of ``like``'s leaves, every one of them as float32 values."""
    sizes = [int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(like)]
    if not any(sizes):
        raise ValueError(
            "measure_link: like= must be a tree of arrays with at least one value (the "
            f"model's params), got leaves of sizes {sizes}."
        )
    return [n for n in sizes if n]  # an empty leaf sends nothing


def pooled_median(times: list[float]) -> float:
    """The median of every process's ``times`` pooled (one agreed value). The slowest
    process's own median would add its lag to every call: in a loop of steps each
    process waits on the others in turn, and their calls average the same."""
    if jax.process_count() == 1:
        return float(statistics.median(times))
    from jax.experimental import multihost_utils

    return float(np.median(multihost_utils.process_allgather(np.asarray(times, np.float64))))


def slowest(seconds: float) -> float:
    """The longest of the processes' ``seconds`` (one agreed value: each process then
    runs the same collectives)."""
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    return float(np.max(multihost_utils.process_allgather(np.float64(seconds))))
