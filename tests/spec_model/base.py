"""Shared types, the mesh and its groups, and exact and bfloat16 means."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

F32 = np.float32
BF16 = ml_dtypes.bfloat16

Tree = dict[str, np.ndarray]  # leaf name -> per-replica array (R, *shape)
Snapshot = dict[str, np.ndarray]
TRAINABLE = ("a", "b")  # the float32 params leaves the loss (and the optimizer) sees


def short_repr(cls):
    """A dataclass repr that shows only the fields that differ from their defaults, so
    that hypothesis's falsifying examples read as the options that matter."""

    def __repr__(self):
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def _repr_pretty_(self, printer, cycle):  # what hypothesis prints examples with
        printer.text(repr(self))

    cls.__repr__ = __repr__
    cls._repr_pretty_ = _repr_pretty_
    return cls


# --- mesh and groups ----------------------------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class Topology:
    """The data axes of the mesh, e.g. ``("node", "local")`` with shape ``(2, 4)``."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coords(self, r: int) -> tuple[int, ...]:
        """Rule: "Replica r is the device at row-major position r"."""
        return tuple(int(c) for c in np.unravel_index(r, self.shape))

    def groups(self, axes: tuple[str, ...] | None) -> list[list[int]]:
        """Rule: "A group named by axes A = the replicas that share their coordinates on
        every data axis NOT in A; the global group = all data axes" (``None``: global)."""
        axes = self.names if axes is None else tuple(axes)
        unknown = set(axes) - set(self.names)
        assert not unknown, f"axes {unknown} are not data axes of {self.names}"
        keep = [i for i, name in enumerate(self.names) if name not in axes]
        out: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            out.setdefault(tuple(c[i] for i in keep), []).append(r)
        return list(out.values())


# --- means --------------------------------------------------------------------------------


def is_floating(x: np.ndarray) -> bool:
    """Rule: "Only floating leaves are averaged" (complex leaves count as floating)."""
    return np.issubdtype(x.dtype, np.inexact)


def exact_mean(xs: np.ndarray) -> np.ndarray:
    """The arithmetic mean over the leading (member) axis, rounded once to the dtype."""
    wide = np.complex128 if np.iscomplexobj(xs) else np.float64
    with np.errstate(invalid="ignore", over="ignore"):
        return xs.astype(wide).mean(axis=0).astype(xs.dtype)


def bf16_mean(xs: np.ndarray) -> np.ndarray:
    """Rule (communication_dtype=jnp.bfloat16): "each member's x (float32) is rounded to
    bf16, summed in float32, divided by |G|, and the mean rounded to bf16 again, then cast
    to the leaf's dtype; complex leaves are averaged as their real and imaginary parts"."""
    if np.iscomplexobj(xs):
        real = bf16_mean(xs.real.astype(F32))
        imag = bf16_mean(xs.imag.astype(F32))
        return (real + 1j * imag).astype(xs.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        sent = xs.astype(F32).astype(BF16).astype(F32)
        total = sent.sum(axis=0, dtype=F32)
        return (total / F32(len(xs))).astype(BF16).astype(xs.dtype)


def group_mean(x: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """Every member of each group receives the plain mean of the group (NaN spreads)."""
    out = x.copy()
    for g in groups:
        out[g] = exact_mean(x[g])
    return out


def used_members(finite: list[bool], policy: str) -> list[int] | None:
    """Which members a mean is taken over, or None for a skipped average.

    Rule: "propagate (default): plain mean, NaN spreads. exclude: mean of the finite
    members only, which every member (the non-finite ones too) receives; if no member is
    finite, nothing changes (as skip). skip: if any member of G is non-finite, the whole
    group keeps its own values this time."
    """
    everyone = list(range(len(finite)))
    if policy == "propagate":
        return everyone
    if policy == "exclude":
        chosen = [i for i in everyone if finite[i]]
        return chosen or None
    if policy == "skip":
        return everyone if all(finite) else None
    raise ValueError(policy)
