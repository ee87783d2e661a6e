"""Launching local JAX processes for tests: free ports, time limits, always reaped."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(__file__).resolve().with_name("mp_worker.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env.pop("XLA_FLAGS", None)
    return env


@dataclasses.dataclass
class Proc:
    popen: subprocess.Popen
    log: pathlib.Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def processes(cmds: list[list[str]], log_dir: pathlib.Path):
    """Starts one process per command (logs in ``log_dir``); kills and reaps on exit."""
    procs: list[Proc] = []
    try:
        for i, cmd in enumerate(cmds):
            log = log_dir / f"process{i}.log"
            with open(log, "wb") as f:
                p = subprocess.Popen(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=worker_env(), cwd=ROOT
                )
            procs.append(Proc(p, log))
        yield procs
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=30)


def wait_all(procs: list[Proc], timeout: float) -> list[int | None]:
    """Waits up to ``timeout`` seconds in all; return codes (None: still running)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    return [p.popen.poll() for p in procs]


def wait_for_text(proc: Proc, text: str, timeout: float) -> bool:
    """Polls ``proc``'s log until it contains ``text`` (False on timeout or exit)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in proc.output():
            return True
        if proc.popen.poll() is not None:
            return text in proc.output()
        time.sleep(0.05)
    return False


def worker_cmds(mode: str, n: int, out: pathlib.Path, ckpt: pathlib.Path, *extra: str):
    port = free_port()
    return [
        [
            sys.executable,
            str(WORKER),
            mode,
            "--port",
            str(port),
            "--processes",
            str(n),
            "--process-id",
            str(i),
            "--out",
            str(out),
            "--ckpt",
            str(ckpt),
            *extra,
        ]
        for i in range(n)
    ]


def run_workers(mode, out, ckpt, *extra, n=2, timeout=120.0) -> list[Proc]:
    """Runs ``n`` workers to completion (or kills them at ``timeout``); asserts success."""
    out.mkdir(parents=True, exist_ok=True)
    with processes(worker_cmds(mode, n, out, ckpt, *extra), out) as procs:
        codes = wait_all(procs, timeout)
        logs = "\n".join(f"--- process {i} ---\n{p.output()[-3000:]}" for i, p in enumerate(procs))
        assert codes == [0] * n, f"workers ended with {codes} (None: killed at {timeout}s)\n{logs}"
    return procs


def run_launcher(cmd: list[str], timeout: float) -> tuple[int, float, str]:
    """Runs a launcher script in its own process group, killed whole at the end (its
    workers go with it); fails the test if it runs past ``timeout``.

    Returns:
      ``(exit code, seconds, output)``.
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=worker_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"{pathlib.Path(cmd[1]).name} ran past {timeout} s:\n{out.decode()[-4000:]}"
        ) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, time.monotonic() - t0, out.decode(errors="replace")
