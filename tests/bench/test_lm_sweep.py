"""benchmarks/lm_sweep.py: the tuning protocol's plans, resumable runs, table and frontier."""

import json
import sys

import pytest
from helpers import load_example


@pytest.fixture(scope="module")
def sweep():
    return load_example("lm_sweep", folder="benchmarks")


def write_record(out, name, loss, link_bytes, done=True):
    """What examples/lm.py writes: its record at the end, its evaluations as it goes."""
    if done:
        record = [{"val_loss": loss, "steps": 1500, "node_link_bytes": link_bytes}]
        (out / f"{name}.json").write_text(json.dumps(record))
    else:
        line = {"step": 700, "val_loss": loss, "node_link_bytes": link_bytes}
        (out / f"{name}.json.progress.jsonl").write_text(json.dumps(line) + "\n")


def test_plans_name_their_runs_and_carry_the_same_steps_and_data(sweep):
    runs = sweep.plan_runs("deep-recipe-seeds:1e-2", tag="q4", extra=["--start", "1500"])
    assert list(runs) == [f"deep_recipe_q4_lr1e-2_seed{s}" for s in (0, 1, 2)]
    for seed, flags in enumerate(runs.values()):
        assert flags[: len(sweep.MODELS["deep"])] == sweep.MODELS["deep"]
        assert flags[-6:] == ["--lr", "0.01", "--seed", str(seed), "--start", "1500"]
        assert all(f in flags for f in sweep.COMMON)
    lr = sweep.plan_runs("lm-ddp-lr", lrs=[4e-3, 8e-3])
    assert list(lr) == ["lm_ddp_lr4e-3_seed0", "lm_ddp_lr8e-3_seed0"]
    assert len(sweep.plan_runs("lm-ddp-lr")) == len(sweep.LRS["ddp"]) >= 4
    for bad in ("lm-ddp", "wide-ddp-lr", "lm-adam-lr", "lm-ddp-seeds:fast"):
        with pytest.raises(SystemExit, match="unknown plan"):
            sweep.plan_runs(bad)


def test_a_cut_sweep_resumes_where_it_stopped(sweep, tmp_path, monkeypatch):
    """Runs with a record are not run again; a run cut short (progress, no record) is."""
    started = []

    def fake_command(name, flags, out):
        started.append(name)
        code = (
            "import json, sys; "
            f"json.dump([{{'val_loss': 1.5, 'steps': 1500, 'node_link_bytes': 7}}],"
            f" open({str(out / (name + '.json'))!r}, 'w'))"
        )
        return ["nice", "-n", "10", sys.executable, "-c", code]

    monkeypatch.setattr(sweep, "command", fake_command)
    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    runs = sweep.plan_runs("lm-ddp-lr", lrs=[1e-3, 2e-3, 4e-3])
    write_record(tmp_path, "lm_ddp_lr1e-3_seed0", 1.2, 10)
    write_record(tmp_path, "lm_ddp_lr2e-3_seed0", 1.9, 10, done=False)  # cut at step 700
    table = sweep.table(runs, tmp_path)
    assert "| lm_ddp_lr2e-3_seed0 | 1.9000 (step 700) |" in table
    assert "| lm_ddp_lr4e-3_seed0 | - | - |" in table
    sweep.run(runs, tmp_path, jobs=2)
    assert started == ["lm_ddp_lr2e-3_seed0", "lm_ddp_lr4e-3_seed0"]
    assert not (tmp_path / "lm_ddp_lr2e-3_seed0.json.progress.jsonl").exists()
    assert (tmp_path / "commands.txt").read_text().count("\n") == 2
    assert "| lm_ddp_lr1e-3_seed0 | 1.2000 | 0.0 |" in sweep.table(runs, tmp_path)
    sweep.run(runs, tmp_path, jobs=2)
    assert len(started) == 2  # all done: nothing runs again


def test_the_frontier_takes_each_setup_at_its_best_rate_against_the_tuned_ddp(sweep, tmp_path):
    ddp_lrs = {"3e-3": (1.30, 1.31, 1.32), "6e-3": (1.20, 1.22, 1.21), "1e-2": (1.25,)}
    for lr, losses in ddp_lrs.items():
        for seed, loss in enumerate(losses):
            write_record(tmp_path, f"lm_ddp_lr{lr}_seed{seed}", loss, 10_000)
    # the recipe is best at 1e-2 on seed 0; a tag is its own setup; a run cut short and a
    # record of another model's DDP-less sweep are left out
    for seed, loss in enumerate((1.23, 1.23, 1.25)):
        write_record(tmp_path, f"lm_recipe_lr1e-2_seed{seed}", loss, 100)
    write_record(tmp_path, "lm_recipe_lr3e-3_seed0", 1.24, 100)
    write_record(tmp_path, "lm_recipe_q4ddp_lr6e-3_seed0", 1.205, 800)
    write_record(tmp_path, "lm_recipe_l8_lr6e-3_seed0", 1.0, 200, done=False)
    write_record(tmp_path, "deep_recipe_lr1e-2_seed0", 1.3, 50)
    rows = sweep.frontier(tmp_path)
    assert [(r["label"], r["lr"], r["seeds"]) for r in rows] == [
        ("DDP", 6e-3, [0, 1, 2]),
        ("4-bit two-level DDP throughout", 6e-3, [0]),
        ("slow-link recipe", 1e-2, [0, 1, 2]),
    ]
    recipe = rows[2]
    assert recipe["gaps"] == pytest.approx([0.03, 0.01, 0.04])  # against DDP's own seeds
    assert (recipe["mean"], recipe["lo"], recipe["hi"]) == pytest.approx((0.08 / 3, 0.01, 0.04))
    assert recipe["ratio"] == 100 and rows[1]["ratio"] == 12.5
    assert sweep.best_within(rows, "lm", 0.05)["label"] == "slow-link recipe"
    assert sweep.best_within(rows, "lm", 0.01) is None  # the 4-bit DDP has one seed only
    assert sweep.best_within(rows, "lm", 0.01, seeds=1)["ratio"] == 12.5
    table = sweep.frontier_table(rows)
    assert "| lm | slow-link recipe | 0.01 | 3 | 1.2367 | +0.0267 [+0.0100, +0.0400] |" in table


def test_the_frontier_command_prints_and_draws(sweep, tmp_path, capsys):
    for seed in range(3):
        write_record(tmp_path, f"lm_ddp_lr6e-3_seed{seed}", 1.2, 10_000)
        write_record(tmp_path, f"lm_recipe_lr6e-3_seed{seed}", 1.205, 100)
    png = tmp_path / "f.png"
    sweep.main(["frontier", "--out", str(tmp_path), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert "lm: within 0.01 on 3 seeds: slow-link recipe at 1/100.0" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
