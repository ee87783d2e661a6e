"""The strategies: flat, finite-only, compressed, two-level and quantized means, and the
functions that build them (the package docstring, ``lsgd_jax.comm``, says how to choose).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lsgd_jax._core import _collectives, _validate
from lsgd_jax.comm import _codec, _quantize, _wire
from lsgd_jax.comm._base import Communication, Mean, logger

FINITE_ONLY_POLICIES = ("exclude", "skip")  # comm.finite_only(policy)


@dataclasses.dataclass(frozen=True)
class Flat(Communication):
    """One all-reduce (a variadic ``psum``) of every floating leaf, divided by the group
    size. See :func:`flat`.

    Example:
      >>> import lsgd_jax
      >>> lsgd_jax.comm.flat() == lsgd_jax.comm.Flat()  # configuration, compared by value
      True
    """

    def mean(self, tree, group, state=None, *, cast=True, step=None) -> Mean:
        del step
        return Mean(_collectives.mean(tree, group, cast), None, state)

    def init(self, tree: Any) -> None:
        del tree


def _log_nonfinite(policy: str, step: Any, replica: Any, excluded: Any) -> None:
    action = {
        "exclude": "left out of the mean and given the mean of the finite replicas",
        "skip": "so its group skipped this average and kept its local values",
    }[policy]
    logger.warning(
        "Mean at step %s: replica %s has non-finite values (%s of its group non-finite); %s.",
        int(step) if step is not None else "?",
        int(replica),
        int(excluded),
        action,
    )


@dataclasses.dataclass(frozen=True)
class FiniteOnly(Communication):
    """A mean that leaves out, or skips for, replicas with non-finite values.

    See :func:`finite_only`.

    Attributes:
      policy: ``"exclude"`` or ``"skip"``.
    """

    policy: str = "exclude"

    @property
    def may_skip(self) -> bool:
        return True

    def __post_init__(self) -> None:
        _validate.one_of(
            self.policy,
            "finite_only policy",
            FINITE_ONLY_POLICIES,
            ": 'exclude' (average the finite replicas only) or 'skip' (no average for a "
            "group with a NaN)",
        )

    def mean(self, tree, group, state=None, *, cast=True, step=None) -> Mean:
        averaged, excluded, finite = _collectives.finite_mean(tree, group, cast)
        if self.policy == "skip":
            skipped = excluded > 0
        else:
            skipped = excluded >= _collectives.group_size(group)
        averaged = jax.tree.map(lambda a, b: jnp.where(skipped, a, b), tree, averaged)
        if logger.isEnabledFor(logging.WARNING):  # else no host callback in the program
            axes = _collectives.bound_axes()
            replica = lax.axis_index(axes) if axes else jnp.zeros([], jnp.int32)
            where = jnp.zeros([], jnp.int32) if step is None else step
            lax.cond(
                finite,
                lambda: None,
                lambda: jax.debug.callback(
                    functools.partial(_log_nonfinite, self.policy), where, replica, excluded
                ),
            )
        return Mean(averaged, skipped, state)

    def init(self, tree: Any) -> None:
        del tree


def _narrow_dtype(value: Any) -> Any:
    """``value`` as a floating dtype narrower than float32 (what ``compressed`` sends)."""
    if value is None:
        raise ValueError(
            "compressed: dtype must be a floating dtype narrower than float32, got None; "
            "use e.g. jnp.bfloat16."
        )
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(
            f"compressed: {value!r} is not a dtype; use a floating dtype narrower than "
            "float32, e.g. jnp.bfloat16."
        ) from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"communication_dtype must be a floating dtype such as jnp.bfloat16, got {value!r}."
        )
    if dtype.itemsize >= 4:
        raise ValueError(
            f"compressed: the dtype on the wire must be narrower than float32 (the values "
            f"are summed in float32, so {dtype.name} would save nothing), got {dtype.name}; "
            "use jnp.bfloat16 (or jnp.float16), or comm.flat() for an exact mean."
        )
    return dtype


def _check_inner_axis(value: Any, what: str) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"{what}: inner_axis must be a mesh axis name (a str such as 'local'), got {value!r}."
        )


@dataclasses.dataclass(frozen=True)
class Compressed(Communication):
    """A mean sent in a narrower floating dtype and summed in float32.

    See :func:`compressed`.

    Attributes:
      dtype: the dtype on the wire, e.g. ``jnp.bfloat16``.
    """

    dtype: Any = jnp.bfloat16

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _narrow_dtype(self.dtype))

    def mean(self, tree, group, state=None, *, cast=True, step=None) -> Mean:
        del step
        return Mean(_wire.narrow_mean(tree, group, self.dtype, cast), None, state)

    def init(self, tree: Any) -> None:
        del tree


@dataclasses.dataclass(frozen=True)
class TwoLevel(Communication):
    """A mean over a group that spans nodes, in two levels. See :func:`two_level`.

    Attributes:
      inner_axis: the mesh axis of one node's devices.
    """

    inner_axis: str = "local"

    def __post_init__(self) -> None:
        _check_inner_axis(self.inner_axis, "two_level")

    def mean(self, tree, group, state=None, *, cast=True, step=None) -> Mean:
        del step
        return Mean(_wire.two_level_mean(tree, group, self.inner_axis, cast), None, state)

    def init(self, tree: Any) -> None:
        del tree


@dataclasses.dataclass(frozen=True)
class Quantized(Communication):
    """A mean sent as small integers with per-block scales. See :func:`quantized`.

    Attributes:
      bits: 8 or 4, the width of each value on the wire.
      block_size: values per float32 scale.
      error_feedback: keep each replica's rounding error and send it with the next mean.
      two_level: over a group that spans nodes, reduce in float32 inside the node first,
        so only the node's shard travels (quantized) across nodes.
      inner_axis: the mesh axis of one node's devices (for ``two_level``).
    """

    bits: int = 8
    block_size: int = 64
    error_feedback: bool = True
    two_level: bool = False
    inner_axis: str = "local"

    @property
    def rounds_small_values(self) -> bool:
        return True

    def alongside(self) -> Communication:
        # in float32 (two-level where this is): no error feedback of their own, and block
        # scales would round small entries such as running variances to zero
        return TwoLevel(self.inner_axis) if self.two_level else Flat()

    def __post_init__(self) -> None:
        bits, block = _codec.check_bits_and_block(self.bits, self.block_size)
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "block_size", block)
        for flag in ("error_feedback", "two_level"):
            value = _validate.boolean(getattr(self, flag), f"quantized: {flag}")
            object.__setattr__(self, flag, value)
        _check_inner_axis(self.inner_axis, "quantized")

    def mean(self, tree, group, state=None, *, cast=True, step=None) -> Mean:
        del step
        value, state = _quantize.quantized_mean(
            tree,
            group,
            state,
            bits=self.bits,
            block_size=self.block_size,
            two_level_inner=self.inner_axis if self.two_level else None,
            cast=cast,
        )
        return Mean(value, None, state)

    @property
    def keeps_state(self) -> bool:
        """True with error feedback, whose residual is kept per replica."""
        return self.error_feedback

    def init(self, tree: Any) -> Any:
        """Zeros shaped like ``tree`` (the residual), or None without error feedback."""
        if not self.error_feedback:
            return None
        if tree is None:
            raise ValueError(
                "quantized(error_feedback=True) keeps a residual shaped like the params on "
                "every replica, so its state needs them: create the averager's state with "
                "averager.init(params) (or model_averaging(averager).init(params)), or use "
                "quantized(error_feedback=False)."
            )
        return _quantize.zeros_state(tree)


def flat() -> Flat:
    """Today's default: one all-reduce of all floating leaves, divided by the group size.

    Leaves narrower than float32 are summed in float32 and rounded once; integer and
    boolean leaves pass unchanged. Exactly PyTorch's averaging.

    Returns:
      A :class:`Communication`.

    Example:
      >>> import lsgd_jax
      >>> avg = lsgd_jax.PeriodicModelAverager(4, communication=lsgd_jax.comm.flat())
      >>> avg.communication
      Flat()
    """
    return Flat()


def finite_only(policy: str = "exclude") -> FiniteOnly:
    """A mean robust to a replica whose values went NaN/Inf.

    ``"exclude"``: the mean of the finite replicas only, which every replica of the group
    receives (the non-finite ones are healed); if no replica is finite, nothing changes.
    ``"skip"``: a group with a non-finite replica does not average this time. Either way
    still one all-reduce (the finiteness flag rides along), and a warning naming the
    replica and step is logged through the ``"lsgd_jax"`` logger (a host callback,
    compiled in while that logger is enabled for WARNING at trace time). A skipped
    average changes nothing but the step count (see the averagers).

    Args:
      policy: ``"exclude"`` or ``"skip"``.

    Returns:
      A :class:`Communication`.

    Example:
      >>> import lsgd_jax
      >>> lsgd_jax.comm.finite_only("skip")
      FiniteOnly(policy='skip')
    """
    return FiniteOnly(policy)


def two_level(inner_axis: str = "local") -> TwoLevel:
    """A global mean in two levels, so that each value crosses the slow link about once.

    Reduce-scatter inside each node (over ``inner_axis``: every device gets the node's
    sum of one shard of the values), all-reduce of the shards across nodes (the only
    step that crosses nodes, carrying 1 / (devices per node) of the values per device),
    all-gather inside the node. A flat ring all-reduce over every device instead puts
    about 2 (n - 1) / n of the values per device on whichever links the ring crosses
    (1.75x the params on the node-to-node link, measured with gloo on 2 x 4 devices).
    A mean inside one node (the hook's node-local phase, a ``"local"`` level) stays one
    all-reduce, and so does a mean over an :class:`~lsgd_jax.IndexGroups` group
    (``pmap``). Exact up to the order of the float32 sums. An ``inner_axis`` that is not
    a mesh axis where the mean runs raises a ValueError. Empty leaves are their own mean.

    Args:
      inner_axis: the mesh axis of one node's devices (``"local"`` in :func:`~lsgd_jax.make_mesh`).

    References:
      Jia et al., `Highly Scalable Deep Learning Training System with Mixed-Precision:
      Training ImageNet in Four Minutes <https://arxiv.org/abs/1807.11205>`_, 2018
      (hierarchical all-reduce).

    Returns:
      A :class:`Communication`.

    Example:
      >>> import lsgd_jax
      >>> tx = lsgd_jax.post_local_sgd(100, communication=lsgd_jax.comm.two_level())
    """
    return TwoLevel(inner_axis)


def compressed(dtype: Any = jnp.bfloat16) -> Compressed:
    """A mean sent in ``dtype`` (e.g. bfloat16) and summed in float32.

    The floating leaves are flattened into one buffer (complex ones as their real and
    imaginary parts), cast to ``dtype`` and split into one chunk per replica; an
    all-to-all hands each replica its chunk from every peer, which it sums in float32;
    an all-gather of the chunk means, again in ``dtype``, returns the whole mean to
    everyone: about half the bytes of a float32 ring all-reduce, and every replica of
    the group gets the same (``dtype``-rounded) result.

    Args:
      dtype: a floating dtype narrower than float32, e.g. ``jnp.bfloat16`` or
        ``jnp.float16`` (float32 or wider would save nothing: a ValueError).

    Returns:
      A :class:`Communication`.

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> lsgd_jax.comm.compressed(jnp.bfloat16).dtype
      dtype(bfloat16)
    """
    return Compressed(dtype)


def quantized(
    bits: int = 8,
    block_size: int = 64,
    error_feedback: bool = True,
    two_level: bool = False,
    inner_axis: str = "local",
) -> Quantized:
    """A mean sent as ``bits``-bit integers with one float32 scale per block.

    The floating leaves travel as one float32 buffer cut into blocks of ``block_size``
    values, each block ``x`` as ``round(x / s)`` with ``s = max|x| / qmax`` (``qmax`` 127
    for 8 bits, 7 for 4), in an ``all_to_all`` and an ``all_gather`` as in
    :func:`compressed`: about 0.27x (int8) or 0.14x (4-bit) the bytes of a float32
    all-reduce, and every replica decodes the same mean. With error feedback each replica
    keeps what its rounding dropped (the strategy's state, ``comm_state``) and sends it
    with the next mean, so the means telescope. A non-finite value makes its block's mean
    NaN (:func:`finite_only` leaves such a replica out instead). The algorithm, its bytes,
    error bounds and the two-level path: docs/options_in_depth.md.

    Args:
      bits: 8 (int8) or 4 (two values per byte).
      block_size: values per scale, a positive int (even for 4 bits), at most 2**24;
        smaller blocks follow the values more closely and cost ``4 / block_size`` bytes
        per value.
      error_feedback: keep the residual (needs the params at init:
        ``averager.init(params)``, ``post_local_sgd(...).init(params)``).
      two_level: reduce inside the node in float32 first; quantize only across nodes.
        A mean over the node's axis alone is then a plain float32 all-reduce.
      inner_axis: the mesh axis of one node's devices (``"local"`` in
        :func:`~lsgd_jax.make_mesh`).

    Returns:
      A :class:`Communication`.

    Raises:
      TypeError: ``block_size`` not an int, a flag not a bool, or ``inner_axis`` not a str.
      ValueError: ``bits`` not 8 or 4, or ``block_size`` out of range (or odd for 4 bits).

    Example:
      >>> import jax.numpy as jnp, lsgd_jax
      >>> avg = lsgd_jax.PeriodicModelAverager(
      ...     8, communication=lsgd_jax.comm.quantized(bits=4, two_level=True))
      >>> avg.init({"w": jnp.ones(3)}).comm_state
      {'w': Array([0., 0., 0.], dtype=float32)}

    References:
      Seide et al., "1-Bit Stochastic Gradient Descent ...", Interspeech 2014;
      Karimireddy et al., "Error Feedback Fixes SignSGD ...", ICML 2019,
      https://arxiv.org/abs/1901.09847. More in docs/options_in_depth.md.
    """
    return Quantized(bits, block_size, error_feedback, two_level, inner_axis)
