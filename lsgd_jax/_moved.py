"""The old module paths, for one release: ``lsgd_jax._schedule`` is now
``lsgd_jax.schedules._schedule``, and so on (see docs/internals.md).

Importing an old path gives a module that names its new home in a DeprecationWarning
and reads every name from there. The names an old module had that its new home lacks
(they went to a neighbouring module, or were renamed, in commit 9c4ecf6) still resolve
from the old path, each with a DeprecationWarning that names where it lives now.
(These modules are private: import the public names from ``lsgd_jax`` or its
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
    "_fsdp": "_core._fsdp",
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

_STATES = {"PostLocalSGDState": "hook:PostLocalSGDState"}
_STATES["ModelAveragerState"] = "averaging:ModelAveragerState"
_STRUCT = {"Struct": "_core._struct:Struct", "static_field": "_core._struct:static_field"}

# What an old module had (at 70159c6, the commit before the move) that its new home
# lacks: old module -> {name: "module:attribute" under lsgd_jax (or "module"), or the
# name of a stand-in defined below, for what is no longer one object}.
LOST: dict[str, dict[str, str]] = {
    "_attempts": {"data_axes": "elastic._attempts:loop_axes"},  # renamed
    "_average_call": {"strategy_alongside": "_moved:_strategy_alongside"},
    "_averager_state": {**_STRUCT, "comm": "comm"},
    "_averaging": {"NONFINITE_POLICIES": "averaging._config:NONFINITE_POLICIES", "comm": "comm"},
    "_chain_order": _STATES,
    "_checkpoint_config": _STATES,
    "_elastic_checkpoint": {"data_axes": "mesh:data_axes"},
    "_membership": {
        name: f"elastic._process:{name}"
        for name in (
            "LeftBehindError",
            "RunOver",
            "external_coordinator",
            "newcomer",
            "note_committed",
            "set_external_coordinator",
        )
    },
    "_optim": {"comm": "comm"},
    "_pairing": _STATES,
    "_phase": {**_STATES, "STATE_TYPES": "_moved:_state_types"},
    "_preflight": _STATES,
    "_step_inputs": {"Identity": "_moved:_Identity"},
    "_quantize": {
        name: f"comm._codec:{name}"
        for name in (
            "MAX_BLOCK",
            "QMAX",
            "check_bits_and_block",
            "dequantize",
            "pack_nibbles",
            "quantize",
            "unpack_nibbles",
            "wire_bytes_per_value",
        )
    },
    "_report": {"Collective": "report._records:Collective", "SCOPES": "report._records:SCOPES"},
    "_resize": {"ModelAveragerState": _STATES["ModelAveragerState"]},
    "_state": _STRUCT,
    "_sync": _STATES,
}

_SAY = {  # what to use instead, where the stand-in is not the same object
    "_average_call.strategy_alongside": "a strategy's own strategy.alongside()",
    "_phase.STATE_TYPES": (
        "a state's KIND (lsgd_jax._core._state_protocol: states(tree, HOOK or AVERAGER)); "
        "this is the tuple (PostLocalSGDState, ModelAveragerState) it was"
    ),
}


class _Identity:
    """The step's last outputs, recognized (``is``) when passed back: now inside
    ``step._step_inputs.Inputs``."""

    def __init__(self, *objects: Any) -> None:
        self.objects = objects

    def same(self, *objects: Any) -> bool:
        return len(objects) == len(self.objects) and all(
            a is b for a, b in zip(objects, self.objects)
        )


def _strategy_alongside(strategy: Any) -> Any:
    """How values averaged alongside the params travel: ``strategy.alongside()``."""
    return strategy.alongside()


def _state_types() -> tuple[type, ...]:
    """The state types that choose a phase: the hook's and the averagers'."""
    from lsgd_jax.averaging import ModelAveragerState
    from lsgd_jax.hook import PostLocalSGDState

    return (PostLocalSGDState, ModelAveragerState)


_MADE = {"_moved:_state_types": _state_types}  # values built when asked for


def _resolve(target: str) -> Any:
    """``"module:attribute"`` (or ``"module"``) under lsgd_jax, as an object."""
    if target in _MADE:
        return _MADE[target]()
    module, _, attribute = target.partition(":")
    found = importlib.import_module(f"lsgd_jax.{module}")
    return getattr(found, attribute) if attribute else found


def _where(target: str) -> str:
    module, _, attribute = target.partition(":")
    return f"lsgd_jax.{module}" + (f".{attribute}" if attribute else "")


class OldModule(ModuleType):
    """``lsgd_jax.<old name>``: the names of its new home, and those it lost, mapped.

    Setting or deleting a name sets or deletes it at the new home (as when the old path
    was the module itself).
    """

    def __init__(self, name: str, home: ModuleType, lost: dict[str, str]) -> None:
        super().__init__(name, home.__doc__)
        object.__setattr__(self, "_home", home)
        object.__setattr__(self, "_lost", lost)

    def __getattr__(self, name: str) -> Any:
        home = object.__getattribute__(self, "_home")
        try:
            return getattr(home, name)
        except AttributeError:
            pass
        lost = object.__getattribute__(self, "_lost")
        if name not in lost:
            raise AttributeError(
                f"module {self.__name__!r} (now {home.__name__}) has no attribute {name!r}"
            )
        old = f"{self.__name__.partition('.')[2]}.{name}"
        instead = _SAY.get(old, _where(lost[name]))
        warnings.warn(
            f"lsgd_jax.{old} has moved: use {instead} (the old path goes in the next "
            "release), or the public names of lsgd_jax.",
            DeprecationWarning,
            stacklevel=2,
        )
        return _resolve(lost[name])

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") and name.endswith("__"):  # the import system's own
            super().__setattr__(name, value)
        else:
            setattr(object.__getattribute__(self, "_home"), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(object.__getattribute__(self, "_home"), name)

    def __dir__(self) -> list[str]:
        home = object.__getattribute__(self, "_home")
        return sorted(set(dir(home)) | set(object.__getattribute__(self, "_lost")))


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lsgd_jax.<old name>`` and loads it from its new home."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != "lsgd_jax" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        old = spec.name.partition(".")[2]
        new = "lsgd_jax." + MOVED[old]
        warnings.warn(
            f"{spec.name} has moved to {new}; import it from there (the old path goes "
            "in the next release), or use the public names of lsgd_jax.",
            DeprecationWarning,
            stacklevel=2,
        )
        return OldModule(spec.name, importlib.import_module(new), LOST.get(old, {}))

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new home ran when the old path was created."""


def install() -> None:
    """Adds the finder of the old paths to ``sys.meta_path`` (once).

    Example:
      >>> import warnings, lsgd_jax
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     from lsgd_jax import _schedule
      ...     from lsgd_jax._quantize import quantize
      >>> _schedule.PeriodicSchedule is lsgd_jax.schedules._schedule.PeriodicSchedule
      True
      >>> quantize is lsgd_jax.comm._codec.quantize
      True
      >>> print(caught[-1].message)
      lsgd_jax._quantize.quantize has moved: use lsgd_jax.comm._codec.quantize (the old
      path goes in the next release), or the public names of lsgd_jax.
    """
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())  # before any finder of real files
