"""communication_report: what a compiled step communicates, read off its HLO."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lsgd_jax._core import _compat
from lsgd_jax.report._hlo import parse_hlo
from lsgd_jax.report._records import CommunicationReport
from lsgd_jax.report._stablehlo import parse_stablehlo


def _find_mesh(args: Iterable[Any]) -> Any:
    import jax

    for leaf in jax.tree.leaves(list(args)):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and hasattr(mesh, "devices"):
            return mesh
    return None


def communication_report(
    jitted_step: Any, *args: Any, mesh: Any = None, platform: str | None = None, **kwargs: Any
) -> CommunicationReport:
    """What a jitted step communicates: one record per collective of its compiled HLO.

    Compiles ``jitted_step`` for ``args`` (nothing runs) and lists every collective
    with its kind, group size, the mesh axes of its groups, the bytes each device sends
    into it, and whether it is ``conditional`` (inside a ``lax.cond``/``lax.switch``
    branch, so it runs only on some steps) or runs on every call.

    Args:
      jitted_step: a ``jax.jit``-wrapped function, an already compiled
        ``jax.stages.Compiled``, or the step of :func:`data_parallel_step`.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` with shardings);
        for a :func:`data_parallel_step` step, its own arguments, e.g. ``(params,
        opt_state, batch)``.
      mesh: the mesh whose axes name the groups; default the mesh of the first argument
        with a ``NamedSharding``.
      platform: when given (e.g. ``"cuda"`` or ``"tpu"``), the step is lowered for that
        platform with ``jax.export`` instead of compiled here, and its StableHLO module is walked
        (before XLA's optimizations, see ``parse_stablehlo``; no device of that kind is
        needed).
      **kwargs: keyword arguments of ``jitted_step``.

    Returns:
      A CommunicationReport (a tuple of Collective); print it for a table.

    Example:
      >>> import jax, jax.numpy as jnp, lsgd_jax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = lsgd_jax.make_mesh(2, 4)
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, "local"), mesh=mesh,
      ...     in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
      >>> x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P(("node", "local"))))
      >>> [(c.kind, c.axes, c.bytes, c.conditional) for c in lsgd_jax.communication_report(f, x)]
      [('all-reduce', ('local',), 4, False)]
    """
    if hasattr(jitted_step, "jit_args"):  # a DataParallelStep: its own signature
        args, jitted_step = jitted_step.jit_args(*args), jitted_step.jitted
    if mesh is None:
        mesh = _find_mesh(list(args) + list(kwargs.values()))
    if platform is not None:
        from jax import export

        exported = export.export(jitted_step, platforms=(platform,))(*args, **kwargs)
        return parse_stablehlo(_compat.stablehlo_module(exported), mesh=mesh)
    if hasattr(jitted_step, "as_text") and not hasattr(jitted_step, "lower"):
        compiled = jitted_step
    else:
        compiled = jitted_step.lower(*args, **kwargs).compile()
    return parse_hlo(compiled.as_text(), mesh=mesh)
