"""``python -m lsgd_jax.planner --setup my_job:planner_inputs --steps 10000``: the plan's
table for a job script's first minute.

``--setup MODULE:FUNCTION`` names a function of no arguments that returns a dict with
``loss_fn``, ``params``, ``batch`` and ``optimizer`` (as :func:`lsgd_jax.plan` takes
them); the mesh is ``make_mesh(--nodes, --devices-per-node)`` (default: every process a
node, its local devices the node's). ``--link-mbit`` and ``--latency-ms`` give the link
instead of measuring it, ``--compute-ms`` the compute. With ``--distributed`` it calls
``jax.distributed.initialize()`` first (every process runs it; process 0 prints).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

KEYS = ("loss_fn", "params", "batch", "optimizer")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


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
    p.add_argument("--steps", type=int, required=True, help="the run's length")
    p.add_argument("--tolerance", type=float, default=0.01, help="quality risk allowed")
    p.add_argument("--nodes", type=_positive, default=None)
    p.add_argument("--devices-per-node", type=_positive, default=None)
    p.add_argument("--link-mbit", type=float, default=None, help="skip the link probe")
    p.add_argument("--latency-ms", type=float, default=None)
    p.add_argument("--compute-ms", type=float, default=None, help="skip the compute probe")
    p.add_argument("--distributed", action="store_true", help="jax.distributed.initialize()")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    if (a.link_mbit is None) != (a.latency_ms is None):
        p.error("give --link-mbit and --latency-ms together (or neither, to measure them)")
    module_name, _, function = a.setup.partition(":")
    if not function:
        p.error(f"--setup {a.setup!r}: use MODULE:FUNCTION, e.g. my_job:planner_inputs")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        p.error(f"--json {a.json!r}: its folder does not exist")
    import jax

    if a.distributed:
        jax.distributed.initialize()
    import lsgd_jax

    make = getattr(importlib.import_module(module_name), function, None)
    inputs = make() if callable(make) else None
    if not isinstance(inputs, dict) or set(KEYS) - set(inputs):
        got = sorted(inputs) if isinstance(inputs, dict) else repr(inputs)[:80]
        p.error(
            f"--setup {a.setup}: must name a function of no arguments that returns a dict "
            f"with {', '.join(KEYS)}; got {got}"
        )
    nodes = a.nodes or jax.process_count()
    per_node = a.devices_per_node or jax.device_count() // nodes
    mesh = lsgd_jax.make_mesh(nodes, per_node)
    link = None
    if a.link_mbit is not None:
        link = lsgd_jax.planner.Link(a.link_mbit * 1e6 / 8, a.latency_ms / 1e3)
    compute = None if a.compute_ms is None else a.compute_ms / 1e3
    found = lsgd_jax.plan(
        inputs["loss_fn"], inputs["params"], inputs["batch"], mesh, inputs["optimizer"],
        num_steps=a.steps, tolerance=a.tolerance, link=link, compute_s=compute,
    )  # fmt: skip
    if jax.process_index() == 0:
        print(found)
        if a.json:
            rows = [{k: v for k, v in vars(r).items()} for r in found.rows]
            with open(a.json, "w") as f:
                json.dump({"chosen": found.chosen.name, "rows": rows}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
