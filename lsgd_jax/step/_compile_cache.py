"""use_compilation_cache: JAX's persistent compilation cache, on by default where it pays.

A process that compiled a step once and comes back (a restarted elastic trainer, a
rerun of a script) compiles the same programs again: with hundreds of leaves, seconds
to minutes per phase. JAX can keep compiled programs in a folder and load them instead
(the key is the program, its compile options and the devices' kind and assignment, so a
rejoining process finds what it compiled for the same membership). The elastic loop
and the examples turn it on; anyone can with one call.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, cast

import jax

ENV = "LSGD_JAX_COMPILATION_CACHE"
DEFAULT = pathlib.Path("~/.cache/lsgd_jax/jax-compilation-cache")


def default_directory() -> str:
    """``$LSGD_JAX_COMPILATION_CACHE``, else ``~/.cache/lsgd_jax/jax-compilation-cache``.

    Example:
      >>> import os
      >>> from lsgd_jax.step import _compile_cache
      >>> os.environ["LSGD_JAX_COMPILATION_CACHE"] = "/scratch/me/jax-cache"
      >>> _compile_cache.default_directory()
      '/scratch/me/jax-cache'
      >>> del os.environ["LSGD_JAX_COMPILATION_CACHE"]
    """
    return os.environ.get(ENV) or str(DEFAULT.expanduser())


def use_compilation_cache(directory: Any = None, *, min_compile_time_s: float = 0.0) -> str:
    """Turns on JAX's persistent compilation cache, so that compiled programs are kept
    on disk and a process that runs them again loads them instead of compiling.

    A restarted or rejoining elastic process then compiles nothing it compiled before
    (``lsgd_jax.elastic.initialize`` calls this), and a rerun of a script starts at
    once. Where the cache is already set (``JAX_COMPILATION_CACHE_DIR`` in the
    environment, or ``jax.config.update("jax_compilation_cache_dir", ...)``), that
    folder is kept. Call it before the programs to keep are compiled (it may come after
    other JAX work).

    What it costs: disk, about the size of each compiled program (a few hundred KB to a
    few MB per program on CPU; a step with one program per phase keeps one per phase,
    per mesh and per set of input shapes); JAX keeps the folder unbounded unless
    ``jax_compilation_cache_max_size`` is set. Reading an entry takes milliseconds.
    The cache is trusted code: keep the folder private (the default is in your home).

    Args:
      directory: the folder (created if missing); None: ``$LSGD_JAX_COMPILATION_CACHE``
        or ``~/.cache/lsgd_jax/jax-compilation-cache``.
      min_compile_time_s: keep only programs that took at least this long to compile
        (JAX's default is 1 s; 0 keeps every program, so that a rejoin compiles
        nothing). Left as it is where the cache was already set.

    Returns:
      The folder in use.

    Example:
      >>> import jax, lsgd_jax
      >>> folder = lsgd_jax.use_compilation_cache()  # before the step compiles
      >>> folder == jax.config.jax_compilation_cache_dir
      True
    """
    current = cast(Any, jax.config).jax_compilation_cache_dir  # (no type stub for it)
    if current:
        return str(current)
    folder = pathlib.Path(directory if directory is not None else default_directory())
    folder = folder.expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    if min_compile_time_s < 0:
        raise ValueError(
            f"use_compilation_cache: min_compile_time_s must be >= 0, got {min_compile_time_s}."
        )
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    return str(folder)
