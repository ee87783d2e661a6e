"""examples/digits_cnn.py runs (quick sizes) and shows what post-local SGD saves."""

import jax
import numpy as np
from helpers import load_example


def test_digits_cnn_quick(capsys):
    digits_cnn = load_example("digits_cnn")
    rows = digits_cnn.main(["--quick", "--no-progress"])  # 48 steps, local SGD from 16
    out = capsys.readouterr().out
    assert "global all-reduces" in out and "hierarchical, H=2/16" in out
    ddp, h4, h16, hier = rows
    steps, start = 48, 16

    # The schedule: DDP all-reduces gradients globally on every step; post-local SGD for
    # 16 steps, then averages models globally at 16, 20, ..., 44 (H=4) or 16, 32 (H=16;
    # and the hierarchy's top level, which counts from step 0).
    assert (ddp["global all-reduces"], ddp["node-local all-reduces"]) == (steps, 0)
    assert (h4["global all-reduces"], h4["node-local all-reduces"]) == (start + 8, steps - start)
    assert (h16["global all-reduces"], h16["node-local all-reduces"]) == (start + 2, steps - start)
    # No gradient all-reduce after the switch; node averages at the even steps 18..46
    # that are not multiples of 16.
    assert (hier["global all-reduces"], hier["node-local all-reduces"]) == (start + 2, 14)

    # Bytes: the gradient all-reduce carries the parameters' floats; a global model
    # average carries them and the batch-norm statistics (mean and var of 8 channels).
    params = digits_cnn.init_model(8, 0)[1]
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    for row in rows:
        sched = row["schedule"]
        assert sched.grad_bytes == param_bytes
        assert sched.average_bytes == (param_bytes + 2 * 8 * 4 if row is not ddp else 0)
        assert sched.always_bytes == 8  # the reported mean loss and summed correct count
        # One switch over the phases: the busiest branch (global gradients + an average,
        # where a run has both) carries exactly both.
        per_branch = {}
        for c in row["report"].where(axes=("node", "local"), conditional=True):
            per_branch[c.branch] = per_branch.get(c.branch, 0) + c.bytes
        assert max(per_branch.values()) == sched.grad_bytes + sched.average_bytes
    mb = [r["cross-node MB/device"] for r in rows]
    assert mb[0] == steps * (param_bytes + 8) / 1e6
    assert mb[0] > mb[1] > mb[2] == mb[3]

    for row in rows:
        h = row["history"]
        assert len(h["loss"]) == steps and h["eval_step"][-1] == steps
        assert h["cross_node_bytes"][-1] == round(row["cross-node MB/device"] * 1e6)
        assert np.isfinite(h["loss"]).all() and row["train loss"] < 1.0
        assert row["test acc"] > 0.6  # 10 classes: chance is 0.1
        assert h["test_acc"][-1] > h["test_acc"][0] + 0.4  # it learned
