"""Validation loss against cross-node bytes (log scale) from ``examples/lm.py --json`` files.

The bytes are those on the links between nodes (every device together, the ledger's
``link_total``) when every record has them, else the cross-node bytes per device.

Each file holds a list of run records (``lm.py --json``); each run is one line, labelled
``LABEL=path`` on the command line or by its method name::

    python benchmarks/lm_bytes_plot.py --out docs/lm_bytes.png \\
        "DDP=benchmarks/results/issue29/r7_ddp_seed0.json" \\
        "slow-link recipe=benchmarks/results/issue29/r6_q8w4_d24_s150_cool03.json"

A dashed horizontal line marks the first run's final loss (DDP's, the target), and each
run's legend entry gives its final loss and its share of the first run's bytes over the
whole run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any


def load(specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``[(label, record)]`` from ``LABEL=path`` or ``path`` arguments (every record of
    each file; a file's records are labelled ``LABEL`` or, without one, by method)."""
    runs = []
    for spec in specs:
        label, _, path = spec.rpartition("=")
        records = json.loads(pathlib.Path(path).read_text())
        for record in records if isinstance(records, list) else [records]:
            if "history" not in record:
                raise ValueError(f"{path}: a record without a history; write it with lm.py --json")
            runs.append((label or record["method"], record))
    if not runs:
        raise ValueError("no runs: pass one or more lm.py --json files")
    return runs


def plot(runs: list[tuple[str, dict[str, Any]]], out: str) -> None:
    """Draws the runs (the first is the reference) into ``out`` (a png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    reference = runs[0][1]
    link = all("eval_node_link_bytes" in r["history"] for _, r in runs)
    series, key = (
        ("eval_node_link_bytes", "node_link_bytes")
        if link
        else ("eval_cross_node_bytes", "cross_node_bytes")
    )
    total = reference[key]
    for label, record in runs:
        h = record["history"]
        mb = [max(b, 1) / 1e6 for b in h[series]]
        steps, loss = h["eval_step"], h["val_loss"]
        shown = [i for i, s in enumerate(steps) if s > 0]  # log x: no step 0
        (line,) = ax.plot([mb[i] for i in shown], [loss[i] for i in shown], "o-", ms=3)
        ratio = total / record[key] if record[key] else float("inf")
        share = f"1/{ratio:.0f}" if ratio >= 10 else f"1/{ratio:.2g}"
        line.set_label(f"{label}: {loss[-1]:.4f}, {share} of the bytes")
    ax.axhline(reference["val_loss"], color="gray", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(
        "MB on the links between nodes, all devices (log scale)"
        if link
        else "cross-node MB per device (log scale)"
    )
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_ylim(top=min(2.4, ax.get_ylim()[1]))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(
        f"byte-level LM, {reference['params']:,} params, {reference['steps']} steps, "
        "2 nodes x 4 devices"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=path or path of lm.py --json files")
    ap.add_argument("--out", required=True, help="the png to write")
    args = ap.parse_args(argv)
    plot(load(args.runs), args.out)


if __name__ == "__main__":
    main()
