"""The README's demo runs and shows what post-local SGD saves."""

from lsgd_jax import demo


def test_demo_compares_ddp_and_post_local_sgd(capsys):
    rows = demo.main(["--steps", "40", "--start", "10", "--periods", "4", "16"])
    out = capsys.readouterr().out
    assert "DDP" in out and "post-local SGD, H=4" in out
    # the loss printed as in the README (4 decimals), so the columns line up
    ddp_line = next(line for line in out.splitlines() if line.startswith("DDP"))
    assert f"{rows[0]['train loss']:.4f}" in ddp_line and str(rows[0]["train loss"]) not in out
    widths = {len(line) for line in out.splitlines()[1:]}
    assert len(widths) == 1, out
    ddp, h4, h16 = rows
    assert ddp["global all-reduces"] == 40 and ddp["node-local all-reduces"] == 0
    # 10 global gradient steps, then averages at steps 10, 14, ..., 38 (H=4) / 10, 26 (H=16).
    assert h4["global all-reduces"] == 10 + 8 and h4["node-local all-reduces"] == 30
    assert h16["global all-reduces"] == 10 + 2
    assert h4["cross-node MB/device"] < ddp["cross-node MB/device"]
    assert all(r["train loss"] < 2.3 for r in rows)  # below chance level (ln 10)
    # compilation is timed apart from the steps (issue 18): every run compiles first
    assert "compile s" in out and "steps s" in out
    assert all(r["compile s"] > 0 for r in rows), rows
