"""A link with latency for ``slow_link.py``'s emulated cluster, on a kernel without netem.

``slow_link.setup`` joins the two namespaces by a veth pair; this module joins them by
two TUN devices instead (named as the veth ends, so the workers' byte counters and
``slow_link.set_rate``'s tbf work on them unchanged) and a relay process that holds both
devices and hands each packet from one to the other ``delay_ms`` after it read it::

    [ns 0] 10.213.17.1 tun <-> relay (holds each packet delay_ms) <-> tun 10.213.17.2 [ns 1]

The tbf on each device's egress caps the rate before the relay, so a packet waits its
serialization and then the delay, as on a long link. The devices live as long as the
relay holds them: stopping it (``stop``) removes them.

    relay = delay_link.setup(prefix, delay_ms=50)   # instead of slow_link.setup
    slow_link.set_rate("20mbit", prefix)
    ...
    delay_link.stop(relay); slow_link.teardown(prefix)

Run ``python benchmarks/delay_link.py --check`` (root) to see the delay it adds (ping).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import pathlib
import select
import socket
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import slow_link as sl  # noqa: E402

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 16000  # large packets: fewer for the relay to carry (it is Python)
READY = "delay_link: ready"
PROBE_PORT = 29600
SERVER = f"""
import socket
s = socket.create_server(("", {PROBE_PORT}))
c, _ = s.accept()
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    if d.endswith(b"?"):
        c.sendall(b"!")
"""
CLIENT = f"""
import socket, time
c = socket.create_connection(("ADDR", {PROBE_PORT}))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t = time.perf_counter(); c.sendall(b"?"); c.recv(1); rtts.append(time.perf_counter() - t)
t = time.perf_counter(); c.sendall(b"x" * (4 << 20)); c.sendall(b"?"); c.recv(1)
s = time.perf_counter() - t
print(f"round trip {{min(rtts) * 1e3:.1f}} ms; 4 MiB in {{s:.2f}} s: {{32 / s:.1f}} Mbit/s")
"""


def _open_tun(namespace: str, name: str) -> int:
    """A TUN device ``name`` made inside ``namespace`` (this thread enters it first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ns = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(ns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _carry(src: int, dst: int, delay: float, stop: threading.Event) -> None:
    """Reads packets from ``src`` and writes each to ``dst`` ``delay`` seconds later."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    while not stop.is_set():
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            try:
                os.write(dst, queue.popleft()[1])
            except OSError:
                pass  # the other device is not up yet (or gone): the packet is lost
        wait = 0.05 if not queue else max(queue[0][0] - now, 0.0)
        ready, _, _ = select.select([src], [], [], wait)
        if ready:
            try:
                packet = os.read(src, 65536)
            except OSError:
                return  # the device is gone (its namespace was deleted)
            queue.append((time.monotonic() + delay, packet))


def relay(prefix: str, delay_ms: float) -> None:
    """The relay process: makes both devices, says it is ready, carries packets until
    killed."""
    fds = [_open_tun(n, v) for n, v in zip(sl.namespaces(prefix), sl.veths(prefix))]
    stop = threading.Event()
    threads = [
        threading.Thread(target=_carry, args=(a, b, delay_ms / 1e3, stop), daemon=True)
        for a, b in (fds, fds[::-1])
    ]
    for t in threads:
        t.start()
    print(READY, flush=True)
    for t in threads:
        t.join()


def setup(prefix: str, delay_ms: float, etc: str = "/etc/netns") -> subprocess.Popen:
    """``slow_link.setup``'s two namespaces, joined through the relay with ``delay_ms``
    each way. Returns the relay's process (give it to :func:`stop`)."""
    if not delay_ms >= 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
    hostname = socket.gethostname()
    for n in sl.namespaces(prefix):
        sl.checked(["ip", "netns", "add", n])
    proc = subprocess.Popen(
        [sys.executable, __file__, "--relay", "--prefix", prefix, "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if READY not in line:
        proc.kill()
        raise sl.CannotRun(f"the delay relay did not start (it said {line!r})")
    for n, v, a in zip(sl.namespaces(prefix), sl.veths(prefix), sl.addresses()):
        sl.checked(["ip", "-n", n, "addr", "add", f"{a}/24", "dev", v])
        sl.checked(["ip", "-n", n, "link", "set", "lo", "up"])
        sl.checked(["ip", "-n", n, "link", "set", v, "mtu", str(MTU), "up"])
        os.makedirs(os.path.join(etc, n), exist_ok=True)
        with open(os.path.join(etc, n, "hosts"), "w") as f:  # gloo dials the hostname
            f.write(f"127.0.0.1 localhost\n{a} {hostname}\n")
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    """Stops the relay (its devices go with it)."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help="time round trips and a transfer")
    ap.add_argument("--rate", default=None, help="a tc rate for the check, e.g. 20mbit")
    ap.add_argument("--prefix", default="lsgddl")
    ap.add_argument("--delay-ms", type=float, default=25.0)
    args = ap.parse_args(argv)
    if args.relay:
        relay(args.prefix, args.delay_ms)
        return 0
    sl.safe_teardown(args.prefix)
    proc = setup(args.prefix, args.delay_ms)
    try:
        if args.rate:
            sl.set_rate(args.rate, args.prefix)
        ns = sl.namespaces(args.prefix)
        server = subprocess.Popen(["ip", "netns", "exec", ns[1], sys.executable, "-c", SERVER])
        time.sleep(1.0)
        out = sl.checked(["ip", "netns", "exec", ns[0], sys.executable, "-c",
                          CLIENT.replace("ADDR", sl.addresses()[1])])  # fmt: skip
        print(out.strip())
        server.kill()
        server.wait()
    finally:
        stop(proc)
        sl.safe_teardown(args.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
