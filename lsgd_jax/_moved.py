"""The old module paths, for one release: ``lsgd_jax._schedule`` is now
``lsgd_jax.schedules._schedule``, and so on (see docs/internals.md).

Importing an old path gives the module at its new home, with a DeprecationWarning that
names it. (These modules are private: import the public names from ``lsgd_jax`` or its
namespaces, e.g. ``lsgd_jax.PeriodicSchedule`` or ``lsgd_jax.schedules``.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {  # old name under lsgd_jax -> its new home under lsgd_jax
    "_validate": "_core._validate",
    "_struct": "_core._struct",
    "_compat": "_core._compat",
    "_collectives": "_core._collectives",
    "_wire": "comm._wire",
    "_quantize": "comm._quantize",
    "_schedule": "schedules._schedule",
    "_averaging": "averaging._averaging",
    "_averager_state": "averaging._averager_state",
    "_average_call": "averaging._average_call",
    "_outer": "averaging._outer",
    "_offload": "averaging._offload",
    "_fragments": "averaging._fragments",
    "_optim": "averaging._optim",
    "_hook": "hook._hook",
    "_state": "hook._state",
    "_mesh": "mesh._mesh",
    "_fsdp": "mesh._fsdp",
    "_sync": "mesh._sync",
    "_step": "step._step",
    "_step_program": "step._step_program",
    "_step_inputs": "step._step_inputs",
    "_phase": "step._phase",
    "_phase_plan": "step._phase_plan",
    "_preflight": "step._preflight",
    "_chain_order": "step._chain_order",
    "_pairing": "step._pairing",
    "_stacked": "step._stacked",
    "_compile_cache": "step._compile_cache",
    "_checkpoint": "checkpoint._checkpoint",
    "_checkpoint_config": "checkpoint._checkpoint_config",
    "_checkpoint_files": "checkpoint._checkpoint_files",
    "_resize": "checkpoint._resize",
    "_report": "report._report",
    "_ledger": "step._ledger",
    "_attempts": "elastic._attempts",
    "_membership": "elastic._membership",
    "_heal": "elastic._heal",
    "_elastic_checkpoint": "elastic._elastic_checkpoint",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lsgd_jax.<old name>`` and loads the module from its new home."""

    def __init__(self) -> None:
        self._homes: dict[str, tuple[Any, Any]] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != "lsgd_jax" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = "lsgd_jax." + MOVED[spec.name.partition(".")[2]]
        warnings.warn(
            f"{spec.name} has moved to {new}; import it from there (the old path goes "
            "in the next release), or use the public names of lsgd_jax.",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._homes[spec.name] = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Already executed at its new home; the import system wrote the old name's spec
        # into it: give it back its own.
        name = module.__spec__.name if module.__spec__ is not None else module.__name__
        module.__spec__, module.__loader__ = self._homes.pop(name)


def install() -> None:
    """Adds the finder of the old paths to ``sys.meta_path`` (once).

    Example:
      >>> import warnings, lsgd_jax
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     from lsgd_jax import _schedule
      >>> _schedule is lsgd_jax.schedules._schedule, "moved" in str(caught[0].message)
      (True, True)
    """
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())  # before any finder of real files
