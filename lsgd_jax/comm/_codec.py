"""Values as small integers with per-block scales: quantize, pack two 4-bit values a
byte, encode a row with its scales into the bytes that travel, and back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lsgd_jax._core import _validate

QMAX = {8: 127, 4: 7}
MAX_BLOCK = 1 << 24  # values per scale; more is a mistake (a block is cut to a chunk anyway)


def check_bits_and_block(bits: Any, block_size: Any) -> tuple[int, int]:
    """``(bits, block_size)`` as ints, or a clear error.

    Args:
      bits: 8 or 4.
      block_size: a positive int, even for 4 bits, at most ``MAX_BLOCK`` (2**24).

    Returns:
      ``(bits, block_size)``.

    Example:
      >>> from lsgd_jax.comm import _codec
      >>> _codec.check_bits_and_block(4, 3)
      Traceback (most recent call last):
      ...
      ValueError: quantized: with bits=4 two values share a byte, so block_size must be even, ...
    """
    if not _validate._is_int(bits) or int(bits) not in QMAX:
        raise ValueError(
            f"quantized: bits must be 8 or 4, got {bits!r}; use bits=8 (int8) or bits=4 "
            "(two values per byte)."
        )
    block = _validate.positive_int(block_size, "quantized: block_size")
    if block > MAX_BLOCK:
        raise ValueError(
            f"quantized: block_size must be at most {MAX_BLOCK} (2**24) values per scale, "
            f"got {block}; typical sizes are 32 to 256 (the default is 64), and a block "
            "longer than one replica's chunk of the values is cut to the chunk anyway."
        )
    if bits == 4 and block % 2:
        raise ValueError(
            f"quantized: with bits=4 two values share a byte, so block_size must be even, "
            f"got {block}; e.g. block_size={block + 1}."
        )
    return int(bits), block


def quantize(x: jax.Array, bits: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Per-block absmax quantization of ``x`` (last axis a multiple of ``block_size``).

    Args:
      x: float32 values, shape ``(..., m * block_size)``.
      bits: 8 or 4.
      block_size: values per scale.

    Returns:
      ``(q, scale)``: ``q`` int8 in ``[-qmax, qmax]`` shaped like ``x``, ``scale`` float32
      of shape ``(..., m)``; ``q * scale`` is within ``scale / 2`` of ``x``. A zero block
      gets scale 1; a block with a NaN or Inf anywhere gets scale NaN (and ``q`` 0).

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _codec
      >>> q, s = _codec.quantize(jnp.array([0.5, -1.0, 0.0, 0.0]), 8, 2)
      >>> q.tolist(), s.tolist()
      ([64, -127, 0, 0], [0.007874015718698502, 1.0])
      >>> _codec.quantize(jnp.array([jnp.nan, 1.0, 2.0, 3.0]), 8, 2)[1].tolist()
      [nan, 0.023622047156095505]
    """
    qmax = QMAX[bits]
    blocks = x.reshape(*x.shape[:-1], -1, block_size)
    # Tested, not left to the max: a max reduction need not propagate NaN.
    finite = jnp.all(jnp.isfinite(blocks), axis=-1)
    scale = jnp.max(jnp.abs(blocks), axis=-1) / qmax
    scale = jnp.where(scale == 0, jnp.float32(1), scale)
    scale = jnp.where(finite, scale, jnp.float32(jnp.nan))
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -qmax, qmax)
    q = jnp.where(finite[..., None], q, 0).astype(jnp.int8)
    return q.reshape(x.shape), scale


def dequantize(q: jax.Array, scale: jax.Array, block_size: int) -> jax.Array:
    """``q * scale`` block by block, in float32.

    Args:
      q: integers, shape ``(..., m * block_size)``.
      scale: float32, shape ``(..., m)``.
      block_size: values per scale.

    Returns:
      float32 values shaped like ``q``.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _codec
      >>> _codec.dequantize(jnp.array([2, -1], jnp.int8), jnp.array([0.5]), 2).tolist()
      [1.0, -0.5]
    """
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, block_size)
    return (blocks * scale[..., None]).reshape(q.shape)


def pack_nibbles(q: jax.Array) -> jax.Array:
    """Two 4-bit integers (in ``[-8, 7]``) per byte: ``q[..., 2i]`` low, ``q[..., 2i+1]`` high.

    Args:
      q: int8, last axis even.

    Returns:
      uint8, half as long on the last axis.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _codec
      >>> b = _codec.pack_nibbles(jnp.array([-7, 7, 1, -1], jnp.int8))
      >>> b.tolist(), _codec.unpack_nibbles(b).tolist()
      ([121, 241], [-7, 7, 1, -1])
    """
    u = lax.bitcast_convert_type(q, jnp.uint8) & jnp.uint8(0x0F)
    return u[..., 0::2] | (u[..., 1::2] << jnp.uint8(4))


def unpack_nibbles(b: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_nibbles`: int8, twice as long on the last axis.

    Args:
      b: uint8 bytes from :func:`pack_nibbles`.

    Returns:
      int8 values in ``[-8, 7]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _codec
      >>> _codec.unpack_nibbles(jnp.array([0xF8], jnp.uint8)).tolist()
      [-8, -1]
    """
    nibbles = jnp.stack([b & jnp.uint8(0x0F), b >> jnp.uint8(4)], axis=-1).astype(jnp.int8)
    nibbles = jnp.where(nibbles > 7, nibbles - 16, nibbles).astype(jnp.int8)
    return nibbles.reshape(*b.shape[:-1], 2 * b.shape[-1])


def encode(rows: jax.Array, bits: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Each row of ``rows`` as the bytes that travel: its integers, then its scales.

    A row of ``c`` values becomes ``c`` bytes (8 bits) or ``c / 2`` (4 bits), followed by
    4 bytes (a float32 scale) per block: one buffer, one collective.

    Args:
      rows: float32, shape ``(r, c)`` with ``c`` a multiple of ``block_size``.
      bits: 8 or 4.
      block_size: values per scale.

    Returns:
      ``(wire, values)``: uint8 bytes of shape ``(r, row_bytes)``, and the float32 values
      the receivers will decode from them.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _codec
      >>> wire, values = _codec.encode(jnp.array([[1.0, -2.0, 0.0, 3.5]]), 4, 4)
      >>> wire.shape, values.tolist()  # 2 bytes of integers, 4 of the scale 0.5
      ((1, 6), [[1.0, -2.0, 0.0, 3.5]])
    """
    q, scale = quantize(rows, bits, block_size)
    ints = pack_nibbles(q) if bits == 4 else lax.bitcast_convert_type(q, jnp.uint8)
    scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8).reshape(rows.shape[0], -1)
    return jnp.concatenate([ints, scale_bytes], axis=1), dequantize(q, scale, block_size)


def decode(wire: jax.Array, bits: int, block_size: int, length: int) -> jax.Array:
    """The float32 values of bytes from :func:`encode`.

    Args:
      wire: uint8, shape ``(r, row_bytes)``.
      bits: 8 or 4.
      block_size: values per scale.
      length: values per row.

    Returns:
      float32, shape ``(r, length)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from lsgd_jax.comm import _codec
      >>> wire, _ = _codec.encode(jnp.array([[0.3, -0.5]]), 8, 2)
      >>> [round(v, 4) for v in _codec.decode(wire, 8, 2, 2)[0].tolist()]
      [0.2992, -0.5]
    """
    n_int = length // 2 if bits == 4 else length
    ints, scale_bytes = wire[:, :n_int], wire[:, n_int:]
    q = unpack_nibbles(ints) if bits == 4 else lax.bitcast_convert_type(ints, jnp.int8)
    scale = lax.bitcast_convert_type(scale_bytes.reshape(wire.shape[0], -1, 4), jnp.float32)
    return dequantize(q, scale, block_size)


def wire_bytes_per_value(bits: int, block_size: int) -> float:
    """Bytes on the wire per value: the integer and its share of a float32 scale.

    Args:
      bits: 8 or 4.
      block_size: values per scale.

    Returns:
      ``bits / 8 + 4 / block_size``.

    Example:
      >>> from lsgd_jax.comm import _codec
      >>> _codec.wire_bytes_per_value(8, 64), _codec.wire_bytes_per_value(4, 64)
      (1.0625, 0.5625)
    """
    return bits / 8 + 4 / block_size
