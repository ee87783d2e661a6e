"""benchmarks/accuracy.py: its quick path runs, and its bytes equal the arithmetic."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("accuracy", ROOT / "benchmarks" / "accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["accuracy"] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_quick_run_bytes_follow_the_schedule_and_it_learns(tmp_path, capsys):
    accuracy = load_benchmark()
    png = tmp_path / "accuracy.png"
    rows = accuracy.main(["--quick", "--plot", str(png)])
    out = capsys.readouterr().out
    assert "| DDP (global grads every step) |" in out and png.stat().st_size > 10_000
    ddp, h4, h16, bf16 = rows
    steps, start = 32, 8  # QUICK: local SGD from step 8

    params = accuracy.digits_cnn.init_model(8, 0)[1]
    P = sum(x.nbytes for x in jax.tree.leaves(params))  # the gradient all-reduce
    BN = 2 * 8 * 4  # batch-norm mean and var of 8 channels, averaged with the params
    M = 8  # the reported loss and correct count, every step
    assert ddp["bytes"] == steps * (P + M) and ddp["ratio"] == 1.0
    for row, h in ((h4, 4), (h16, 16)):
        averages = len(range(start, steps, h))  # at the switch, then every h steps
        want = start * P + steps * M + averages * (P + BN)
        assert row["bytes"] == want
        assert row["ratio"] == want / ddp["bytes"]
        assert row["wire_ratio"] == row["ratio"]  # all float32 all-reduces: same factor
        assert row["peak"] == P + BN + M  # an averaging step
    assert ddp["bytes"] > h4["bytes"] > h16["bytes"] > bf16["bytes"]

    # bf16 + delta, lowered for CUDA: an all-to-all of the flattened (padded to 8 chunks)
    # params in bf16 and an all-gather of one chunk; the statistics likewise.
    def compressed(n):
        padded = -(-n // 8) * 8
        return 2 * padded + 2 * padded // 8

    average = compressed(P // 4) + compressed(BN // 4)
    assert bf16["lowered"] and bf16["bytes"] == start * P + steps * M + 2 * average
    assert bf16["cpu_bytes"] > h16["bytes"]  # XLA on CPU sends bf16 collectives as f32
    assert bf16["wire_ratio"] < bf16["ratio"]  # all-to-all sends 7/8, all-reduce 7/4

    for row in rows:
        assert row["acc_mean"] > 0.6  # 10 classes: chance is 0.1


def test_noisy_digits_split_and_noise():
    accuracy = load_benchmark()
    data = accuracy.noisy_digits(0)
    clean = accuracy.digits_cnn.load_digits(0)
    assert len(data.y_train) + len(data.y_test) == len(clean.y_train) + len(clean.y_test)
    assert abs(len(data.y_train) - len(data.y_test)) <= 1
    assert data.x_train.shape[1:] == (8, 8, 1) and data.x_train.dtype == np.float32
    # the pixel noise (sigma 0.5) pushes pixels well outside [0, 1]
    assert data.x_test.min() < -1 and data.x_test.max() > 2
    same_split = accuracy.noisy_digits(0, label_noise=0.0, pixel_noise=0.0)
    np.testing.assert_array_equal(data.y_test, same_split.y_test)  # test labels are clean
    flipped = np.mean(data.y_train != same_split.y_train)
    assert 0.15 < flipped < 0.25  # 20% of the training labels
    noise = data.x_test - same_split.x_test
    assert 0.45 < noise.std() < 0.55
