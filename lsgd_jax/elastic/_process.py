"""This process's place in an elastic run: the errors that end a run or a process,
and the flags it keeps (an external coordinator, whether it has committed a step).
"""

from __future__ import annotations


class CoordinatorLostError(RuntimeError):
    """The coordination service (process 0's, or ``lsgd_jax.elastic_coordinator``'s) is
    gone, or every process that held the model is: no elastic run can go on.

    Example:
      >>> import lsgd_jax
      >>> issubclass(lsgd_jax.elastic.CoordinatorLostError, RuntimeError)
      True
    """


class LeftBehindError(RuntimeError):
    """The other processes declared this one dead (it was stopped, or cut off, for longer
    than the heartbeat timeout) and went on without it: it is not in the live set, and
    holds a model they no longer follow. Restart the process: it then joins the running
    job like any restarted one.

    Example:
      >>> import lsgd_jax
      >>> issubclass(lsgd_jax.elastic.LeftBehindError, RuntimeError)
      True
    """


class RunOver(SystemExit):
    """This process (re)started after the run it would join was over: it exits with
    status 0 (a ``SystemExit``), after one line saying so."""


# This process's part in the job: whether the coordination service runs elsewhere, and
# whether an attempt of any loop of this process committed (it is no newcomer).
_PROCESS = {"external_coordinator": False, "committed": False}


def set_external_coordinator(value: bool) -> None:
    """Records whether the coordination service runs in a process of its own."""
    _PROCESS["external_coordinator"] = bool(value)


def external_coordinator() -> bool:
    """Whether the coordination service runs in a process of its own (then process 0 is
    a trainer like any other)."""
    return _PROCESS["external_coordinator"]


def note_committed() -> None:
    """Records that an attempt of this process committed: it is part of the run (a new
    loop it builds, e.g. to go on from a result, is not a newcomer)."""
    _PROCESS["committed"] = True


def newcomer() -> bool:
    """Whether no attempt of this process committed yet (it (re)started)."""
    return not _PROCESS["committed"]


def run_over(me: int, step: int) -> RunOver:
    """The exit of a process that arrives after the run ended at ``step``; prints the one
    line that says so."""
    line = (
        f"lsgd_jax.elastic: process {me} arrived after the run was over (it ended at step "
        f"{step}); nothing to do, exiting with status 0."
    )
    print(line, flush=True)
    return RunOver(0)


class RunEndedError(RuntimeError):
    """Another process ended the run with an error in the user's code or arguments (its
    own traceback shows it): every process stops, as after that error on each."""
