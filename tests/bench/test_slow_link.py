"""benchmarks/slow_link.py: its arithmetic, arguments, teardown and "cannot run" path.

The benchmark itself (two namespaces, a capped veth, about 15 minutes) is not run here;
these check, in about a second, the parts that decide what it reports and what it
leaves behind.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import lsgd_jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "slow_link.py"


def load():
    spec = importlib.util.spec_from_file_location("slow_link", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["slow_link"] = module
    spec.loader.exec_module(module)
    return module


sl = load()


def by_name(start=4):
    return {c["name"]: c for c in sl.configs(start)}


def test_schedule_matches_the_library_averagers():
    start, cfgs = 4, by_name(4)
    h4 = lsgd_jax.PeriodicModelAverager(4, warmup_steps=start)
    h16 = lsgd_jax.PeriodicModelAverager(16, warmup_steps=start)
    hier = lsgd_jax.HierarchicalModelAverager({2: "local", 16: ("node", "local")}, start)
    groups = {0: None, 1: "local", 2: "global"}
    for s in range(100):
        assert sl.schedule(cfgs["DDP"], s) == ("global", None)
        grad = "global" if s < start else "local"
        assert sl.schedule(cfgs["post-local SGD, H=4"], s) == (
            grad, "global" if h4.level(s) else None,
        )  # fmt: skip
        assert sl.schedule(cfgs["post-local SGD, H=16"], s) == (
            grad, "global" if h16.level(s) else None,
        )  # fmt: skip
        name = "hierarchy 2: local, 16: global, no grad all-reduce"
        assert sl.schedule(cfgs[name], s) == (
            "global" if s < start else None, groups[hier.level(s)],
        )  # fmt: skip


def test_allreduces_per_step_and_the_bound():
    cfgs = by_name()
    per_step = {n: sl.allreduces_per_step(c) for n, c in cfgs.items()}
    assert per_step == {
        "DDP": (0.0, 1.0),
        "post-local SGD, H=4": (1.0, 0.25),
        "post-local SGD, H=16": (1.0, 1 / 16),
        # 7 node averages (steps 2, 4, ..., 14 mod 16) and one global per 16 steps
        "hierarchy 2: local, 16: global, no grad all-reduce": (7 / 16, 1 / 16),
        # the ways a mean travels change the bytes, not when the means happen
        "DDP, two-level": (0.0, 1.0),
        "H=16, two-level": (1.0, 1 / 16),
        "H=16, int8 two-level": (1.0, 1 / 16),
        "H=16, 4-bit two-level": (1.0, 1 / 16),
        "H=16, 4-bit two-level, no grad all-reduce": (0.0, 1 / 16),
        "hierarchy 2: local, 16: 4-bit two-level, no grad all-reduce": (7 / 16, 1 / 16),
        "H=16, 4-bit two-level, no grad all-reduce, delay 8": (0.0, 1 / 16),
        "DDP, int8 gradients": (0.0, 1.0),
        "DDP, 4-bit gradients": (0.0, 1.0),
        "H=16, 4-bit two-level, no grad all-reduce, int8 warm-up": (0.0, 1 / 16),
        "H=16, 4-bit two-level, no grad all-reduce, 4-bit warm-up": (0.0, 1 / 16),
        "hierarchy 2: local, 16: 4-bit two-level, no grad all-reduce, 4-bit warm-up": (
            7 / 16,
            1 / 16,
        ),
        "H=16, int8 two-level, int8 warm-up": (1.0, 1 / 16),
        "hierarchy 2: local, 16: int8 two-level, no grad all-reduce, 4-bit warm-up": (
            7 / 16,
            1 / 16,
        ),
    }
    c, loc, g = 0.1, 0.05, 1.0
    assert sl.speedup_bound(c, loc, g, cfgs["DDP"]) == pytest.approx(1.0)
    assert sl.speedup_bound(c, loc, g, cfgs["post-local SGD, H=4"]) == pytest.approx(
        (c + g) / (c + loc + g / 4)
    )
    assert sl.predicted_step(c, loc, g, cfgs["post-local SGD, H=16"]) == pytest.approx(
        c + loc + g / 16
    )
    # steps 4 .. 79: H=16 averages at 4, 20, 36, 52, 68; the hierarchy at 16, 32, 48, 64
    assert sl.global_allreduces(cfgs["post-local SGD, H=16"], 4, 80) == 5
    hier = cfgs["hierarchy 2: local, 16: global, no grad all-reduce"]
    assert sl.global_allreduces(hier, 4, 80) == 4
    assert sl.global_allreduces(hier, 0, 80) == 4 + 4  # and the gradient means before
    assert sl.global_allreduces(cfgs["DDP"], 0, 80) == 80


def test_step_time_weights_each_kind_by_its_frequency():
    cfg = by_name()["post-local SGD, H=4"]
    steps = list(range(40))
    # averaging steps (4, 8, ...) take 1.0 s, others 0.2 s; one outlier of 9 s
    times = [1.0 if s >= 4 and s % 4 == 0 else 0.2 for s in steps]
    times[13] = 9.0
    assert sl.step_time(times, steps, cfg) == pytest.approx(0.25 * 1.0 + 0.75 * 0.2)
    kinds = sl.step_kinds(times[4:], steps[4:], cfg)
    assert kinds["local/global"] == [9, 1.0] and kinds["local/-"][0] == 27
    assert sl.step_time([0.3, 0.5, 0.4], [0, 1, 2], by_name()["DDP"]) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="no timed step"):
        sl.step_time([0.2] * 3, [5, 6, 7], cfg)  # no averaging step timed


def test_steps_to_target_uses_a_running_mean():
    losses = [1.0, 0.5, 0.05, 0.5, 0.3, 0.2, 0.1]
    assert sl.steps_to_target(losses, 0.2, window=1) == 2
    assert sl.steps_to_target(losses, 0.2, window=3) == 6  # (0.3 + 0.2 + 0.1) / 3
    assert sl.steps_to_target(losses, 0.01, window=3) is None


def test_arguments():
    args = sl.parse([])
    assert args.rate_list == ["1gbit", "100mbit"] and args.start < args.steps
    assert sl.parse(["--rates", "2.5gbit,10mbit"]).rate_list == ["2.5gbit", "10mbit"]
    assert sl.parse_rate("100mbit") == 1e8 and sl.parse_rate("1Gbit") == 1e9
    for bad in (["--rates", "fast"], ["--start", "0"], ["--steps", "10"], ["--rates", ","]):
        with pytest.raises(SystemExit):
            sl.parse(bad)
    with pytest.raises(ValueError, match="not a tc rate"):
        sl.parse_rate("-1mbit")


def test_requirements_say_what_is_missing():
    assert sl.requirements(euid=0, which=lambda tool: f"/usr/sbin/{tool}") == []
    missing = sl.requirements(euid=1000, which=lambda tool: None)
    assert len(missing) == 3 and "root" in missing[0]
    assert any("`ip`" in m for m in missing) and any("`tc`" in m for m in missing)


class FakeIp:
    """Records commands; says every object is gone, as ip does after a teardown."""

    def __init__(self, fail_on=None):
        self.calls, self.fail_on = [], fail_on

    def __call__(self, cmd):
        self.calls.append(cmd)
        gone = cmd[:3] in (["ip", "netns", "del"], ["ip", "link", "del"])
        failed = gone or (self.fail_on is not None and cmd[: len(self.fail_on)] == self.fail_on)
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, "", "Cannot find it")


def test_teardown_is_idempotent_and_never_raises(tmp_path):
    for ns in sl.namespaces("tst"):
        (tmp_path / ns).mkdir()
        (tmp_path / ns / "hosts").write_text("10.0.0.1 host\n")
    (tmp_path / "other").mkdir()
    fake = FakeIp()
    sl.teardown("tst", run=fake, etc=str(tmp_path))
    sl.teardown("tst", run=fake, etc=str(tmp_path))  # nothing left: still fine
    assert sorted(os.listdir(tmp_path)) == ["other"]
    once = [
        ["ip", "netns", "del", "tst0"], ["ip", "netns", "del", "tst1"],
        ["ip", "link", "del", "tst0v"], ["ip", "link", "del", "tst1v"],
    ]  # fmt: skip
    assert fake.calls == once + once


def test_a_failed_setup_says_which_command(tmp_path):
    fake = FakeIp(fail_on=["ip", "link", "add"])
    with pytest.raises(sl.CannotRun, match="ip link add tst0v type veth peer name tst1v"):
        sl.setup("tst", run=fake, etc=str(tmp_path))
    with pytest.raises(sl.CannotRun, match="tbf"):
        sl.set_rate("1gbit", "tst", run=FakeIp(fail_on=["tc"]))


def test_setup_writes_hosts_mapping_the_hostname_to_each_namespace(tmp_path):
    fake = FakeIp()
    sl.setup("tst", run=fake, etc=str(tmp_path))
    import socket

    for ns, addr in zip(sl.namespaces("tst"), sl.addresses()):
        assert f"{addr} {socket.gethostname()}" in (tmp_path / ns / "hosts").read_text()
    assert ["ip", "-n", "tst0", "link", "set", "lo", "up"] in fake.calls


def test_autogroup_nice_is_restored(tmp_path):
    path = tmp_path / "autogroup"
    path.write_text("/autogroup-7 nice 3\n")
    with sl.autogroup_nice(-10, str(path)):
        assert path.read_text() == "-10"
    assert path.read_text() == "3"
    with sl.autogroup_nice(None, str(tmp_path / "absent")):
        pass
    with pytest.raises(sl.CannotRun, match="autogroup"), sl.autogroup_nice(-1, str(tmp_path)):
        pass


def run_script(*args, env=None):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def test_cannot_run_prints_what_it_needs_without_a_traceback():
    out = run_script("--check", env={"PATH": "/nonexistent"})  # no ip, no tc
    assert out.returncode == 2, out
    assert "cannot run here; it needs" in out.stderr and "iproute2" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2",
)
def test_check_and_teardown_for_real_leave_nothing_behind():
    # A prefix of its own, so that a benchmark running meanwhile is not disturbed.
    for args in (["--teardown"], ["--check"], ["--teardown"]):
        out = run_script(*args, "--prefix", "lsgdtst")
        assert out.returncode in (0, 2), out  # 2: e.g. a container without CAP_NET_ADMIN
        assert "Traceback" not in out.stderr
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "lsgdtst" not in names
    if os.path.isdir("/etc/netns"):
        assert not [p for p in os.listdir("/etc/netns") if p.startswith("lsgdtst")]


def test_how_each_run_communicates():
    cfgs = by_name()
    assert [sl.comm_of(c) for c in cfgs.values()] == [
        "flat", "flat", "flat", "flat", "two_level", "two_level", "int8", "int4", "int4", "int4",
        "int4", "int8", "int4", "int4", "int4", "int4", "int8", "int8",
    ]  # fmt: skip
    # the hook's global gradient mean: two-level wherever the run is not flat, unless
    # the run quantizes it (DDP and the warm-up, with error feedback)
    assert sl.hook_comm_of(cfgs["H=16, int8 two-level"]) == "two_level"
    assert sl.hook_comm_of(cfgs["DDP, 4-bit gradients"]) == "int4"
    assert sl.global_piece(cfgs["DDP, int8 gradients"]) == "int8"
    warm = cfgs["H=16, 4-bit two-level, no grad all-reduce, 4-bit warm-up"]
    assert (sl.hook_comm_of(warm), sl.comm_of(warm)) == ("int4", "int4")
    best = cfgs["hierarchy 2: local, 16: int8 two-level, no grad all-reduce, 4-bit warm-up"]
    assert (sl.hook_comm_of(best), sl.comm_of(best)) == ("int4", "int8")
    assert not best["grad_allreduce"]
    assert sl.global_piece(cfgs["DDP, two-level"]) == "two_level"
    assert sl.global_piece(cfgs["H=16, 4-bit two-level"]) == "int4"
    # steps 0 .. 79, switch at 4: 4 gradient means, then averages at 4, 20, 36, 52, 68
    assert sl.global_events(cfgs["H=16, int8 two-level"], 0, 80) == (4, 5)
    assert sl.global_events(cfgs["DDP, two-level"], 0, 80) == (80, 0)
    assert sl.strategy("flat") is None
    assert sl.strategy("int4") == lsgd_jax.comm.quantized(4, two_level=True)
    assert cfgs["H=16, 4-bit two-level, no grad all-reduce, delay 8"]["delay"] == 8


def load_lm_link():
    spec = importlib.util.spec_from_file_location("lm_link", ROOT / "benchmarks" / "lm_link.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lm_link_times_the_steps_up_to_the_first_evaluation_at_the_target():
    # benchmarks/lm_link.py: the language model across the same emulated link.
    ll = load_lm_link()
    assert ll.sl is not None and ll.PREFIX != sl.PREFIX  # its own namespaces
    evals = [(0, 6.0), (2, 3.0), (4, 2.5), (6, 2.4)]
    step_s = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert ll.time_to(evals, step_s, 2.5) == (4, 10.0)
    assert ll.time_to(evals, step_s, 2.0) is None

    def run(method, evals, step_s, tx):
        return {"method": method, "evals": evals, "step_s": step_s, "loss": [], "tx_bytes": tx}

    local2 = run("local2", [(0, 6.0), (6, 2.45)], [1.0] * 6, 5)
    workers = [
        {"runs": [run("ddp", evals, step_s, 100), local2]},
        {"runs": [run("ddp", evals, step_s, 200), run("local2", [], [], 7)]},
    ]
    ddp, local = ll.summarize(workers, None)
    assert ddp["target"] == 2.4 and ddp["time_to_target_s"] == 21.0 and ddp["link_bytes"] == 300
    assert local["steps_to_target"] is None and local["link_bytes"] == 12  # 2.45 > 2.4
    ddp, local = ll.summarize(workers, 2.5)
    assert (ddp["steps_to_target"], local["steps_to_target"]) == (4, 6)
    table = ll.markdown([ddp, local], "cmd", "100mbit")
    assert "| local2 | 2.4500 | +0.0500 |" in table and "| 1.67 |" in table  # 10 s / 6 s
    assert "| 0.0 | - | 25.0 |" in table  # 12 B on the veths, no ledger: 300 / 12
    workers[0]["runs"][1]["ledger_link_bytes"] = 11_000_000
    assert "| 11.0 | 25.0 |" in ll.markdown(ll.summarize(workers, 2.5), "cmd", "100mbit")


def test_lm_link_arguments():
    ll = load_lm_link()
    assert ll.parse([]).methods.startswith("ddp")
    args = ll.parse(["--outer-decay", "--outer-lr", "0.5"])
    assert args.outer_decay and args.outer_lr == 0.5 and args.outer_momentum == 0.9
    cool = ll.parse(["--outer-cooldown", "0.3", "--steps", "100", "--start", "20"])
    lm = ll._lm()
    outer = lm.outer_of_args(cool, lm.parse_method("diloco8"))  # 10 outer steps
    assert (outer["cooldown"], outer["outer_steps"]) == (0.3, 10)
    with pytest.raises(SystemExit):
        ll.parse(["--methods", "local32,ddp"])  # DDP first: it sets the target
    with pytest.raises(SystemExit):
        ll.parse(["--global-batch", "12"])  # not a multiple of 2 x 4 devices


def test_runs_are_chosen_by_substrings_and_names_with_commas_by_semicolons():
    def chosen(runs):
        return [c["name"] for c in sl.chosen_configs(sl.parse(["--runs", runs]))]

    assert chosen("H=4") == ["DDP", "post-local SGD, H=4"]  # DDP first, always
    best = "hierarchy 2: local, 16: int8 two-level, no grad all-reduce, 4-bit warm-up"
    assert chosen(best + ";") == ["DDP", best]
    assert len(chosen(best)) > 5  # split at its commas: " no grad all-reduce" matches many
