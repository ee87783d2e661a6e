"""What lsgd_jax needs from JAX that has no public API yet, in one place.

Each function here reaches into ``jax._src``; ``tests/package/test_compat.py`` checks that every
one still finds what it needs, so a JAX release that moves them fails that test loudly
instead of the library failing (or silently degrading) elsewhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def mapped_axis_names() -> tuple[Any, ...]:
    """The names of the ``pmap`` / ``vmap`` axes bound where this runs (none: ``()``).

    ``shard_map``'s manual axes are public (``jax.sharding.get_abstract_mesh()``); the
    named axes of ``pmap`` are not.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lsgd_jax._core import _compat
      >>> jax.vmap(lambda x: x + len(_compat.mapped_axis_names()), axis_name="i")(jnp.zeros(2))
      Array([1., 1.], dtype=float32)
    """
    from jax._src import core

    return tuple(core.unsafe_get_axis_names())


def all_gather_invariant() -> Callable[..., Any] | None:
    """JAX's ``all_gather_invariant`` (an all-gather typed as invariant), if present.

    ``lax.all_gather`` types its result as varying over the axis although every replica
    holds the same values; the invariant form says so, which lets the result become a
    replicated value. None when this JAX has no such function (callers then use
    ``lax.all_gather``).

    Example:
      >>> from lsgd_jax._core import _compat
      >>> callable(_compat.all_gather_invariant())
      True
    """
    from jax._src.lax import parallel

    return getattr(parallel, "all_gather_invariant", None)


def backends_are_initialized() -> bool:
    """Whether JAX's backend (its devices, the XLA client) has started.

    Flags such as the collective timeout and ``jax.distributed.initialize`` only take
    effect before that.

    Example:
      >>> import jax
      >>> from lsgd_jax._core import _compat
      >>> _ = jax.devices(); _compat.backends_are_initialized()
      True
    """
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def distributed_client() -> Any | None:
    """The ``jax.distributed`` client (its key-value store, ``get_live_nodes``), or None
    when ``jax.distributed`` is not initialized.

    Example:
      >>> from lsgd_jax._core import _compat
      >>> _compat.distributed_client() is None  # a single-process session
      True
    """
    from jax._src import distributed

    return distributed.global_state.client


def _compile_functions() -> tuple[tuple[Any, str], ...]:
    from jax._src import compiler, pjit

    # jit's tracing (also of a jitted function's body), its lowering to StableHLO, and
    # XLA's compilation (or a persistent-cache hit).
    return (
        (pjit, "_infer_params"),
        (pjit, "_resolve_and_lower"),
        (compiler, "compile_or_get_cached"),
    )


COMPILE_FUNCTIONS = _compile_functions()
_COMPILE_CODE = {(m.__file__, name) for m, name in COMPILE_FUNCTIONS}


def compiling(thread_id: int) -> bool:
    """Whether the thread ``thread_id`` is tracing, lowering or compiling a jitted program.

    Read from the thread's Python stack (XLA's compilation releases the GIL, so another
    thread can look while it runs).

    Example:
      >>> import threading
      >>> from lsgd_jax._core import _compat
      >>> _compat.compiling(threading.get_ident())
      False
    """
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if (frame.f_code.co_filename, frame.f_code.co_name) in _COMPILE_CODE:
            return True
        frame = frame.f_back
    return False


def distributed_runtime_service(
    bind_address: str, num_processes: int, heartbeat_timeout_s: int, shutdown_timeout_s: int
) -> Any:
    """JAX's coordination service (what ``jax.distributed.initialize`` starts in process
    0), started here, recoverable: a task that dies may connect again.

    ``lsgd_jax.elastic_coordinator`` runs it in a process of its own, so that no trainer
    is the one whose death ends the run. The returned object has ``shutdown()``.

    Example:
      >>> from lsgd_jax._core import _compat
      >>> service = _compat.distributed_runtime_service("127.0.0.1:0", 2, 3, 5)  # doctest: +SKIP
      >>> service.shutdown()  # doctest: +SKIP
    """
    from jax._src.lib import _jax

    return _jax.get_distributed_runtime_service(
        bind_address,
        num_processes,
        heartbeat_timeout=heartbeat_timeout_s,
        shutdown_timeout=shutdown_timeout_s,
        recoverable=True,
    )


def stablehlo_module(source: Any) -> Any:
    """A StableHLO module object (``jaxlib.mlir.ir.Module``) to walk, in a context with
    JAX's dialects (``stablehlo``, ``sdy``, ``func``, ...) registered.

    ``source`` is a ``jax.export.Exported`` (its module, deserialized) or a module's
    text (parsed). ``jax.interpreters.mlir.make_ir_context`` is JAX's own context
    factory; ``Exported.mlir_module(serialized=False)`` needs such a context around it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lsgd_jax._core import _compat
      >>> exported = jax.export.export(jax.jit(jnp.sin), platforms=("cuda",))(jnp.ones(2))
      >>> _compat.stablehlo_module(exported).operation.name
      'builtin.module'
    """
    from jax.interpreters import mlir
    from jaxlib.mlir import ir

    with mlir.make_ir_context():
        if isinstance(source, str):
            return ir.Module.parse(source)
        return source.mlir_module(serialized=False)


def chain_inits(init: Any) -> tuple[Any, ...] | None:
    """The init functions of the transformations an ``optax.chain`` is made of, given
    the chain's ``init``; None for any other init.

    optax keeps them in the closure of its ``init_fn`` (``init_fns``); no public API
    says what a chain holds. The chain-order check uses it to know which tuples of an
    optimizer state are chains (a transformation's own state may be a tuple too).

    Example:
      >>> import optax
      >>> from lsgd_jax._core import _compat
      >>> len(_compat.chain_inits(optax.chain(optax.clip(1.0), optax.sgd(0.1)).init))
      2
      >>> _compat.chain_inits(optax.clip(1.0).init) is None
      True
    """
    code = getattr(init, "__code__", None)
    if (
        code is None
        or getattr(init, "__qualname__", "") != "chain.<locals>.init_fn"
        or not str(getattr(init, "__module__", "")).startswith("optax")
    ):
        return None
    cells = dict(zip(code.co_freevars, getattr(init, "__closure__", None) or ()))
    try:
        inits = cells["init_fns"].cell_contents
    except (KeyError, ValueError):
        return None
    return tuple(inits) if isinstance(inits, (tuple, list)) else None
