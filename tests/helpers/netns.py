"""Several hosts on one machine: network namespaces joined by veth pairs to a bridge.

`with Network(["trainer", "monitor"]) as net:` gives each host a namespace of its own
with one interface, `eth0`, on a private 10.x.y.0/24 subnet that exists only inside
them (and on a link the test's own namespace gets, `.254`, so the test can observe);
`net.popen(host, cmd)` runs a command there; `net.cut(host)` / `net.heal(host)` take its
link down and up (a partition). Everything is removed on exit, even after a failure.
Needs root and `ip`; `Network.skip_reason()` says why not, for a test to skip.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import time

__all__ = ["Network"]

_COUNTER = itertools.count()
_IP_TIMEOUT = 10  # seconds for one `ip` command


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


class Network:
    """Hosts (namespaces) on one switch (a bridge in a namespace of its own)."""

    def __init__(self, hosts: list[str]) -> None:
        n = next(_COUNTER)
        self.tag = f"ol{os.getpid()}x{n}"
        self.hosts = list(hosts)
        self.subnet = _free_subnet()
        base = self.subnet.network_address
        self.addr = {host: str(base + i + 1) for i, host in enumerate(self.hosts)}
        self.observer = str(base + 254)  # the test's own end
        self.netns = {host: f"{self.tag}-{host}" for host in self.hosts}
        self._switch = f"{self.tag}-switch"
        self._root_link = f"ol{os.getpid() % 100000}x{n}"[:15]
        self._procs: list[subprocess.Popen] = []

    @staticmethod
    def skip_reason() -> str | None:
        """Why hosts cannot be built here, or None."""
        if shutil.which("ip") is None:
            return "`ip` (iproute2) is not installed"
        if os.geteuid() != 0:
            return "building network namespaces needs root"
        name = f"ol{os.getpid()}probe"
        done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=_IP_TIMEOUT)
        if done.returncode != 0:
            return f"`ip netns add` is not permitted here: {done.stderr.strip()}"
        try:  # what _build() needs besides: a bridge and a veth pair (kernel modules a sandbox may lack)
            for what, args in (("a bridge", ("link", "add", "br0", "type", "bridge")),
                               ("a veth pair", ("link", "add", "a0", "type", "veth", "peer", "name", "b0"))):
                made = _ip(*args, netns=name, check=False)
                if made.returncode != 0:
                    return f"`ip link add` of {what} is not permitted here: {made.stderr.strip()}"
        finally:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_IP_TIMEOUT)
        return None

    def __enter__(self) -> Network:
        try:
            self._build()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _build(self) -> None:
        sw = self._switch
        _ip("netns", "add", sw)
        _ip("link", "add", "br0", "type", "bridge", netns=sw)
        _ip("link", "set", "br0", "up", netns=sw)
        prefix = self.subnet.prefixlen
        for host, ns in self.netns.items():
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", netns=ns)
            port = f"p-{host}"[:15]
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
            _ip("addr", "add", f"{self.addr[host]}/{prefix}", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", port, "master", "br0", netns=sw)
            _ip("link", "set", port, "up", netns=sw)
        _ip("link", "add", self._root_link, "type", "veth", "peer", "name", "p-observer", "netns", sw)
        _ip("addr", "add", f"{self.observer}/{prefix}", "dev", self._root_link)
        _ip("link", "set", self._root_link, "up")
        _ip("link", "set", "p-observer", "master", "br0", netns=sw)
        _ip("link", "set", "p-observer", "up", netns=sw)
        for host in self.hosts:  # the bridge forwards once its ports are up: wait for it
            self.wait_reachable(host)

    def wait_reachable(self, host: str, timeout: float = 10.0) -> None:
        """Until the observer reaches `host` (a TCP connect answered, even refused)."""
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as s:
                s.settimeout(0.5)
                try:
                    s.connect((self.addr[host], 9))  # nothing listens: a refusal proves the path
                    return
                except ConnectionRefusedError:
                    return
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {host} ({self.addr[host]}) unreachable after {timeout}s")
            time.sleep(0.05)

    def popen(self, host: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` on `host` in a session of its own; killed on exit if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns[host], *map(str, cmd)],
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def cut(self, host: str) -> None:
        """Partition `host`: its link goes down (its address stays; packets go nowhere)."""
        _ip("link", "set", "eth0", "down", netns=self.netns[host])

    def heal(self, host: str) -> None:
        _ip("link", "set", "eth0", "up", netns=self.netns[host])

    def pids(self, host: str) -> list[int]:
        """Every process in `host`'s namespace (all of them started by this test)."""
        done = _ip("netns", "pids", self.netns[host], check=False)
        return [int(p) for p in done.stdout.split()]

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process on `host`; the pids killed."""
        killed = self.pids(host)
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed

    def _remove(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts:
            self.kill_host(host)  # anything the test's processes left there
        _ip("link", "del", self._root_link, check=False)
        for ns in [*self.netns.values(), self._switch]:
            _ip("netns", "del", ns, check=False)  # one never made: a harmless error
        deadline = time.monotonic() + 10  # namespaces go away asynchronously, with their links
        while _ip("link", "show", self._root_link, check=False).returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.05)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no route of this machine's own namespace touches."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                            timeout=_IP_TIMEOUT).stdout
    used = []
    for word in routes.split():
        try:
            used.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{random.randrange(100, 250)}.{random.randrange(256)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")
