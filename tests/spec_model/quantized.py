"""Quantized means (comm.quantized): blocks, scales, residuals, bytes."""

from __future__ import annotations

import dataclasses

import numpy as np

from spec_model.base import F32, exact_mean, short_repr

# --- quantized means (comm.quantized) -----------------------------------------------------


@short_repr
@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """``comm.quantized(bits, block_size, error_feedback, two_level)``, inner axis "local"."""

    bits: int = 8
    block_size: int = 64
    error_feedback: bool = True
    two_level: bool = False


QMAX = {8: 127, 4: 7}


def quantize_blocks(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """What the receivers decode from ``x`` (last axis whole blocks), in float32.

    Rule: "a block x travels as q = round(x / s), s = max|x| / qmax (qmax 127 for 8 bits,
    7 for 4 bits)"; "a zero block gets scale 1; a block with a NaN or Inf anywhere gets
    scale NaN" (so "that whole block of the mean is NaN", "wherever in the block it
    sits"). ``round`` is half to even (jnp.round).
    """
    qmax = F32(QMAX[bits])
    blocks = x.astype(F32).reshape(*x.shape[:-1], -1, block)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scale = np.abs(blocks).max(axis=-1) / qmax
        scale = np.where(scale == 0, F32(1), scale)
        scale = np.where(np.isfinite(blocks).all(axis=-1), scale, F32(np.nan)).astype(F32)
        q = np.clip(np.round(blocks / scale[..., None]), -qmax, qmax)
        q = np.where(np.isnan(q), F32(0), q).astype(F32)
        return (q * scale[..., None]).reshape(x.shape)


def quant_layout(length: int, inner: int, outer: int, bits: int, block_size: int):
    """``(block, chunk, padded)``, or None where the mean is sent in float32.

    Rule (``_quantize.plan``): "Each replica's chunk is its share of the values (of the
    shard), padded to whole blocks, and a block is never longer than the chunk"; "the
    bytes over the outer group are compared ...: all-to-all + all-gather, 2 (outer - 1)
    x chunk bytes, against a ring all-reduce, 2 (outer - 1) / outer x 4 x ceil(length /
    inner)" (None when the integers send no fewer); "a group of one" sends no integers.
    The docstring does not spell out "bits=4: a block of an even length"; it is read
    from the code.
    """
    if length == 0 or outer == 1:
        return None
    values = -(-length // inner)
    share = -(-values // outer)
    block = min(block_size, share + share % 2 if bits == 4 else share)
    chunk = -(-share // block) * block
    chunk_bytes = chunk * bits // 8 + 4 * (chunk // block)
    if outer * chunk_bytes >= 4 * values:  # both sides times outer / (2 (outer - 1))
        return None
    return block, chunk, inner * outer * chunk


def wire(kind: str, operand_bytes: int, group: int) -> int:
    """Rule (``Collective.wire_bytes``): "Ring all-reduce 2 (g - 1) / g x bytes;
    all-gather (g - 1) x bytes; reduce-scatter and all-to-all (g - 1) / g x bytes", for a
    group of g, rounded to whole bytes."""
    factor = {"all-reduce": 2 * (group - 1) / group, "all-gather": group - 1}
    return round(operand_bytes * factor.get(kind, (group - 1) / group))


def bytes_across(strategy: str | QuantConfig, length: int, nodes: int, local: int) -> int:
    """Wire bytes one device sends in collectives whose groups span nodes, for a global
    mean of ``length`` float32 values on a ``nodes x local`` mesh. ``strategy``: "flat",
    "two_level", or a ``QuantConfig``.

    Rules: flat: "one all-reduce of every floating leaf". two_level: "reduce-scatter
    inside each node, all-reduce of the shards across nodes (the only step that crosses
    nodes, carrying 1 / (devices per node) of the values per device), all-gather inside
    the node". quantized: "an all_to_all (each replica receives its chunk from every
    peer) and an all_gather of the chunk means", of the chunk's integers and scales
    (``chunk x bits / 8`` bytes, plus 4 a block), over all replicas (one level) or, with
    two_level, across nodes on the node's shard; where quantizing would send no fewer
    bytes on the link, the float32 mean: one all-reduce (one level), the two-level mean
    (two_level).
    """
    if nodes == 1:
        return 0
    n = nodes * local
    flat = wire("all-reduce", 4 * length, n)
    two_level = wire("all-reduce", 4 * -(-length // local), nodes)
    if strategy == "flat":
        return flat
    if strategy == "two_level":
        return two_level
    q = strategy
    inner = local if q.two_level and local > 1 else 1  # a node of one: one level
    layout = quant_layout(length, inner, n // inner, q.bits, q.block_size)
    if layout is None:
        return two_level if inner > 1 else flat
    block, chunk, _ = layout
    outer = n // inner
    chunk_bytes = chunk * q.bits // 8 + 4 * (chunk // block)
    return wire("all-to-all", outer * chunk_bytes, outer) + wire("all-gather", chunk_bytes, outer)


def quantized_one_level(rows: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The one-level quantized mean of ``rows`` (g members in position order, each g
    chunks): ``(mean, residuals)``.

    Rule: "an all_to_all hands each replica its chunk from every peer, its own included,
    quantized alike; it dequantizes, sums in float32 and divides: its chunk of the mean;
    it quantizes that chunk mean again and an all_gather ... returns the whole mean";
    "a replica's residual holds its stage-1 rounding error on every chunk, and, on the
    chunk it summed, n times the stage-2 rounding error of that chunk mean"; "the
    residual stays finite (0 where the values were not)". Replica at position j sums
    chunk j.
    """
    g = len(rows)
    x = rows.reshape(g, g, -1)  # member, chunk
    sent = quantize_blocks(x, bits, block)
    with np.errstate(invalid="ignore", over="ignore"):
        total = sent[0].copy()
        for m in range(1, g):
            total = total + sent[m]
        chunk_mean = total / F32(g)
        sent2 = quantize_blocks(chunk_mean, bits, block)
        residual = x - sent
        for j in range(g):
            residual[j, j] = residual[j, j] + F32(g) * (chunk_mean[j] - sent2[j])
    residual = np.where(np.isfinite(residual), residual, F32(0))
    return sent2.reshape(-1), residual.reshape(g, -1)


def quantized_group_mean(
    xs: np.ndarray, q: QuantConfig, inner: int
) -> tuple[np.ndarray, np.ndarray]:
    """The quantized mean of the flat buffers ``xs`` (values plus residuals, one row per
    member in row-major order) and the members' new residuals.

    Rule: one level (``inner == 1``) or, with two_level, "a float32 reduce-scatter inside
    the node ..., the quantized mean across nodes of this device's shard of the node's
    sum, a float32 all-gather inside the node. The residual is then this device's
    shard's: zero elsewhere"; where the integers would put no fewer bytes on the link
    they cross (``quant_layout``), "the mean is sent in float32 instead: one all-reduce,
    or with two levels the float32 two-level mean ... It is exact, and the residual
    becomes zero"; padding follows the data (zeros, cut off again).
    """
    g, length = xs.shape
    outer = g // inner
    layout = quant_layout(length, inner, outer, q.bits, q.block_size)
    if layout is None:
        return exact_mean(xs), np.zeros_like(xs)
    block, _, padded = layout
    x = np.zeros((g, padded), F32)
    x[:, :length] = xs
    if inner == 1:
        mean, residual = quantized_one_level(x, q.bits, block)
        return mean[:length], residual[:, :length]
    nodes = x.reshape(outer, inner, padded)  # a member is (node position, local index)
    with np.errstate(invalid="ignore", over="ignore"):
        sums = nodes[:, 0].copy()
        for i in range(1, inner):
            sums = sums + nodes[:, i]
    width = padded // inner
    mean = np.zeros(padded, F32)
    residual = np.zeros((outer, inner, padded), F32)
    for i in range(inner):  # local device i sums shard i of its node
        part = slice(i * width, (i + 1) * width)
        mean[part], residual[:, i, part] = quantized_one_level(sums[:, part], q.bits, block)
    with np.errstate(invalid="ignore"):
        mean = mean / F32(inner)
    return mean[:length], residual.reshape(g, padded)[:, :length]
