"""``python -m lsgd_jax.planner --setup my_job:planner_inputs --steps 10000``: the plan's
table for a job script's first minute.

``--setup MODULE:FUNCTION`` names a function of no arguments that returns a dict with
``loss_fn``, ``params``, ``batch`` and ``optimizer`` (as :func:`lsgd_jax.plan` takes
them); the mesh is ``make_mesh(--nodes, --devices-per-node)`` (default: every process a
node, its local devices the node's). ``--link-mbit`` and ``--latency-ms`` give the link
instead of measuring it, ``--compute-ms`` the compute (then no kind of step is timed;
``--phase-budget-s`` bounds that timing). With ``--distributed`` it calls
``jax.distributed.initialize()`` first (every process runs it; process 0 prints).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

KEYS = ("loss_fn", "params", "batch", "optimizer")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def _number(low: float, strict: bool) -> Any:
    """An argparse type: a finite float above ``low`` (or at least, unless ``strict``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and (value > low if strict else value >= low)):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if strict else '>='} {low:g}, got {text!r}"
            )
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> None:
    """The command (``argv``: its arguments; default ``sys.argv[1:]``).

    Example:
      >>> from lsgd_jax.planner.__main__ import main
      >>> main(["--setup", "my_job", "--steps", "100"])
      Traceback (most recent call last):
      SystemExit: 2
    """
    p = argparse.ArgumentParser(prog="python -m lsgd_jax.planner", description=__doc__)
    p.add_argument("--setup", required=True, help="MODULE:FUNCTION returning the inputs")
    p.add_argument("--steps", type=_positive, required=True, help="the run's length")
    p.add_argument("--tolerance", type=_number(0.0, False), default=0.01,
                   help="quality risk allowed")  # fmt: skip
    p.add_argument("--nodes", type=_positive, default=None)
    p.add_argument("--devices-per-node", type=_positive, default=None)
    p.add_argument("--link-mbit", type=_number(0.0, True), default=None,
                   help="skip the link probe")  # fmt: skip
    p.add_argument("--latency-ms", type=_number(0.0, False), default=None)
    p.add_argument("--compute-ms", type=_number(0.0, False), default=None,
                   help="skip the compute probe")  # fmt: skip
    p.add_argument("--phase-budget-s", type=_number(0.0, False), default=60.0,
                   help="seconds of predicted steps, in all, to time every kind of step "
                   "of every candidate (0: none)")  # fmt: skip
    p.add_argument("--distributed", action="store_true", help="jax.distributed.initialize()")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    if (a.link_mbit is None) != (a.latency_ms is None):
        p.error("give --link-mbit and --latency-ms together (or neither, to measure them)")
    module_name, _, function = a.setup.partition(":")
    if not function:
        p.error(f"--setup {a.setup!r}: use MODULE:FUNCTION, e.g. my_job:planner_inputs")
    if a.json and (
        os.path.isdir(a.json) or not os.path.isdir(os.path.dirname(os.path.abspath(a.json)))
    ):
        p.error(f"--json {a.json!r}: give a file in a folder that exists")
    import jax

    if a.distributed:
        try:
            jax.distributed.initialize()
        except (ValueError, RuntimeError) as e:
            p.error(
                f"--distributed: jax.distributed.initialize() found no cluster ({e}); run it "
                "under SLURM, Open MPI or a TPU pod, or set JAX_COORDINATOR_ADDRESS, "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID"
            )
    import lsgd_jax

    inputs = _inputs(p, a.setup, module_name, function)
    mesh = _mesh(p, a.nodes, a.devices_per_node)
    link = None
    if a.link_mbit is not None:
        link = lsgd_jax.planner.Link(a.link_mbit * 1e6 / 8, a.latency_ms / 1e3)
    compute = None if a.compute_ms is None else a.compute_ms / 1e3
    try:
        found = lsgd_jax.plan(
            inputs["loss_fn"], inputs["params"], inputs["batch"], mesh, inputs["optimizer"],
            num_steps=a.steps, tolerance=a.tolerance, link=link, compute_s=compute,
            phase_budget_s=a.phase_budget_s,
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        p.error(f"--setup {a.setup}: {e}")
    if jax.process_index() == 0:
        print(found)
        if a.json:
            _write_json(a.json, found)
    sys.stdout.flush()


def _write_json(path: str, found: Any) -> None:
    """The plan's rows and what they were predicted from, as JSON."""
    hidden = ("candidate", "elapsed_s")  # the curve and the cumulative seconds
    rows = [{k: v for k, v in vars(r).items() if k not in hidden} for r in found.rows]
    flat = found.flat_link
    with open(path, "w") as f:
        json.dump({
            "chosen": found.chosen.name, "tolerance": found.tolerance,
            "link": [found.link.bytes_per_s, found.link.latency_s],
            "flat_link": None if flat is None else [flat.bytes_per_s, flat.latency_s],
            "compute_s": found.compute_s, "probe_s": found.probe_s,
            "phase_budget_s": found.phase_budget_s, "timed_calls": found.timed_calls,
            "timing_s": found.timing_s, "call_overhead_s": found.call_overhead_s,
            "rows": rows,
        }, f, indent=1)  # fmt: skip


def _mesh(p: argparse.ArgumentParser, nodes: int | None, per_node: int | None) -> Any:
    """``make_mesh(--nodes, --devices-per-node)``, or exit 2 naming the flag to fix."""
    import jax

    import lsgd_jax

    nodes = nodes or jax.process_count()
    per_node = per_node or jax.device_count() // nodes
    if nodes < 2:
        p.error(
            f"the mesh would have one node ({jax.process_count()} process): pass --nodes N "
            f"of 2 or more (e.g. --nodes 2 for {jax.device_count()} devices in two nodes), "
            "or run one process per node with --distributed"
        )
    if nodes * per_node > jax.device_count():
        p.error(
            f"--nodes {nodes} x --devices-per-node {per_node} needs {nodes * per_node} "
            f"devices, but this job has {jax.device_count()}"
        )
    return lsgd_jax.make_mesh(nodes, per_node)


def _inputs(p: argparse.ArgumentParser, setup: str, module_name: str, function: str) -> dict:
    """What ``--setup``'s function returns, or exit 2 naming what is wrong with it."""
    try:
        make = getattr(importlib.import_module(module_name), function, None)
    except (ImportError, ValueError, TypeError) as e:
        p.error(
            f"--setup {setup}: cannot import {module_name!r} ({e}); give a module's import "
            "name (my_job, not my_job.py) on PYTHONPATH, then :FUNCTION"
        )
    if not callable(make):
        p.error(f"--setup {setup}: {module_name} has no function {function!r} (got {make!r})")
    try:
        inputs = make()
    except TypeError as e:
        p.error(f"--setup {setup}: the function must take no arguments ({e})")
    if not isinstance(inputs, dict) or set(KEYS) - set(inputs):
        got = sorted(inputs) if isinstance(inputs, dict) else repr(inputs)[:80]
        p.error(
            f"--setup {setup}: must name a function of no arguments that returns a dict "
            f"with {', '.join(KEYS)}; got {got}"
        )
    return inputs


if __name__ == "__main__":
    main()
