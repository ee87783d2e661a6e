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
import tempfile
import warnings
from typing import Any, cast

import jax

from lsgd_jax._core import _validate

ENV = "LSGD_JAX_COMPILATION_CACHE"
DEFAULT = pathlib.Path("~/.cache/lsgd_jax/jax-compilation-cache")
_WARNED: set[str] = set()  # folders already warned about (once each)


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


def _configured() -> tuple[str, str] | None:
    """``(folder, where it is set)`` where JAX's cache folder is set already, else None."""
    current = cast(Any, jax.config).jax_compilation_cache_dir  # (no type stub for it)
    if not current:
        return None
    from_env = os.environ.get("JAX_COMPILATION_CACHE_DIR") == str(current)
    return str(current), "JAX_COMPILATION_CACHE_DIR" if from_env else "jax_compilation_cache_dir"


def use_compilation_cache(
    directory: str | os.PathLike[str] | None = None, *, min_compile_time_s: float = 0.0
) -> str | None:
    """Turns on JAX's persistent compilation cache, so that compiled programs are kept
    on disk and a process that runs them again loads them instead of compiling.

    A restarted or rejoining elastic process then compiles nothing it compiled before
    (``lsgd_jax.elastic.initialize`` calls this), and a rerun of a script starts at
    once. Where the cache is already set (``JAX_COMPILATION_CACHE_DIR`` in the
    environment, or ``jax.config.update("jax_compilation_cache_dir", ...)``), that
    folder is kept, and checked like one of its own (a URL such as ``gs://...`` is
    left to JAX). Call it before the programs to keep are compiled (it may come after
    other JAX work).

    The cache is an optimisation: where the folder cannot be used (it cannot be created,
    or written to, e.g. a read-only home, or a file in its place), a ``RuntimeWarning``
    naming the folder and how to choose another is issued once for that folder, and
    JAX compiles without a cache; an explicit ``directory`` too. It costs disk, about
    a program's size per program (docs/performance.md); keep the folder private.

    Args:
      directory: the folder (created if missing); None: ``$LSGD_JAX_COMPILATION_CACHE``
        or ``~/.cache/lsgd_jax/jax-compilation-cache``.
      min_compile_time_s: keep only programs that took at least this long to compile,
        in seconds (JAX's default is 1; 0 keeps every program, so that a rejoin compiles
        nothing). Left as it is where the cache was already set.

    Returns:
      The folder in use, or None where the folder could not be used (the warning says
      why; programs are then compiled every time).

    Raises:
      TypeError: ``directory`` is not a path, or ``min_compile_time_s`` is not a number.
      ValueError: ``directory`` is empty or blank or holds a null character, or
        ``min_compile_time_s`` is negative or not finite.

    Example:
      >>> import jax, lsgd_jax
      >>> folder = lsgd_jax.use_compilation_cache()  # before the step compiles
      >>> folder == jax.config.jax_compilation_cache_dir
      True
    """
    folder = _check_directory(directory)
    seconds = _validate.real_number(
        min_compile_time_s, "use_compilation_cache: min_compile_time_s", "min_compile_time_s=1.0"
    )
    if seconds < 0:
        raise ValueError(
            f"use_compilation_cache: min_compile_time_s must be >= 0 seconds, got "
            f"{min_compile_time_s!r}; pass e.g. min_compile_time_s=1.0 (0 keeps every program)."
        )
    configured = _configured()
    if configured is not None:
        current, setting = configured
        problem = None if "://" in current else _unusable(pathlib.Path(current))
        if problem is None:
            return current
        _warn_once(
            current,
            f"use_compilation_cache: JAX's compilation cache folder {current} (set by "
            f"{setting}) cannot be used ({problem}); JAX compiles without the cache (and "
            f"warns when it tries it). Set {setting} to a writable folder, or leave it "
            f"unset for use_compilation_cache's own (${ENV} or {DEFAULT}).",
        )
        return None
    problem = _unusable(folder)
    if problem is not None:
        _warn_once(
            str(folder),
            f"use_compilation_cache: cannot keep compiled programs in {folder} "
            f"({problem}); compiling without the cache. To keep them, choose a "
            f"writable folder: use_compilation_cache(directory=...) (in "
            f"elastic.initialize: compilation_cache=...) or the environment "
            f"variable {ENV}.",
        )
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", seconds)
    return str(folder)


def _warn_once(folder: str, message: str) -> None:
    """A RuntimeWarning about ``folder``, the first time only."""
    if folder not in _WARNED:
        _WARNED.add(folder)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _check_directory(directory: Any) -> pathlib.Path:
    """``directory`` (or the default folder) as an absolute path, without touching it."""
    what = "directory"
    if directory is None:
        directory = default_directory()
        what = f"the folder of ${ENV}" if os.environ.get(ENV) else what
    elif not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            "use_compilation_cache: directory must be a folder's path (a str or "
            f"pathlib.Path) or None for the default, got {directory!r} "
            f"({type(directory).__name__})."
        )
    text = os.fspath(directory)
    fix = (
        "pass a folder, e.g. '~/.cache/lsgd_jax/jax-compilation-cache', or None for "
        f"${ENV} or that one"
    )
    if not text:
        raise ValueError(f"use_compilation_cache: {what} is an empty path; {fix}.")
    if isinstance(text, str) and not text.strip():
        raise ValueError(
            f"use_compilation_cache: {what} is blank ({text!r}: white space only); {fix}."
        )
    if "\0" in str(text):
        raise ValueError(
            f"use_compilation_cache: {what} holds a null character, which no path may "
            f"hold, got {text!r}; {fix}."
        )
    return pathlib.Path(directory).expanduser().absolute()


def _unusable(folder: pathlib.Path) -> str | None:
    """Why ``folder`` cannot hold the cache (created if missing, then written to), or
    None where it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".lsgd_jax-write-check-")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        blocking = [p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()]
        if blocking:
            return f"{blocking[0]} is a file, not a folder"
        return f"cannot create or write to it: {error.strerror or error}"
    return None
