"""benchmarks/lm_bytes_plot.py: loss against cross-node bytes from lm.py's JSON records."""

import json

import pytest
from helpers import load_example


def load_script():
    return load_example("lm_bytes_plot", folder="benchmarks")


def record(method, total, losses):
    steps = [0, 10, 20]
    return {
        "method": method,
        "params": 1000,
        "steps": 20,
        "val_loss": losses[-1],
        "cross_node_bytes": total,
        "history": {
            "eval_step": steps,
            "val_loss": losses,
            "eval_cross_node_bytes": [0, total // 2, total],
        },
    }


def test_it_plots_labelled_runs_and_names_a_bad_file(tmp_path):
    script = load_script()
    (tmp_path / "ddp.json").write_text(json.dumps([record("ddp", 10_000_000, [5.0, 2.0, 1.5])]))
    (tmp_path / "r.json").write_text(json.dumps([record("diloco24", 100_000, [5.0, 2.2, 1.49])]))
    runs = script.load([f"DDP={tmp_path / 'ddp.json'}", str(tmp_path / "r.json")])
    assert [label for label, _ in runs] == ["DDP", "diloco24"]
    out = tmp_path / "plot.png"
    script.main([f"DDP={tmp_path / 'ddp.json'}", str(tmp_path / "r.json"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # with node-link bytes on every record, the x axis is theirs
    linked = [record("ddp", 10_000_000, [5.0, 2.0, 1.5]), record("r", 100_000, [5.0, 2.2, 1.4])]
    for r, total in zip(linked, (40_000_000, 400_000)):
        r["node_link_bytes"] = total
        r["history"]["eval_node_link_bytes"] = [0, total // 2, total]
    (tmp_path / "linked.json").write_text(json.dumps(linked))
    script.main([str(tmp_path / "linked.json"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text(json.dumps([{"method": "ddp"}]))
    with pytest.raises(ValueError, match="without a history"):
        script.load([str(tmp_path / "bad.json")])
