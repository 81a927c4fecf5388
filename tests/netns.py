"""A NAT test bed in Linux network namespaces: a public segment, two NAT routers, a peer behind each.

    198.18.0.1/24   pub     the "internet": bridge br0, the coordinator/relay, coturn (STUN/TURN) on :3478
    198.18.0.11     nat_a   router: wan0 on the public segment, lan0 198.19.1.1/24, MASQUERADE out of wan0
    198.18.0.12     nat_b   router: wan0 on the public segment, lan0 198.19.2.1/24, MASQUERADE out of wan0
    198.19.1.2      peer_a  behind nat_a (default route via 198.19.1.1)
    198.19.2.2      peer_b  behind nat_b (default route via 198.19.2.1)

Addresses come from 198.18.0.0/15 (benchmarking space, used by nothing else here). Each topology gets namespace
names with a random suffix, and interfaces are created directly inside their namespaces, so parallel runs share
nothing and may reuse the same addresses.

Why each piece (measured, see DESIGN.md "Testing what crosses a network"):
- each router drops NEW/INVALID inbound on its public side (INPUT and FORWARD): without it the first remote ICE
  check leaves a conntrack entry that moves the local peer's outgoing checks to a new port and ICE deadlocks;
- the public namespace has a default route (a stub veth), or coturn drops allocations it cannot route;
- `symmetric=True` adds `--random` to MASQUERADE: STUN alone then fails and only a TURN relay gets through.

Use from a test (CI runs as root; elsewhere skip with `netns_unavailable()`'s reason):

    with nat_topology() as net:
        net.start_coturn()
        argv = net.cmd(net.peer_a, sys.executable, "-m", "some.module")   # for trio.run_process / open_process
        net.run(net.pub, "ip", "addr")                                    # synchronous, checked
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

PUB_IP = "198.18.0.1"
NAT_A_WAN = "198.18.0.11"
NAT_B_WAN = "198.18.0.12"
PEER_A_IP = "198.19.1.2"
PEER_B_IP = "198.19.2.2"
STUN_PORT = 3478
TURN_USER = "mesh"
TURN_PASS = "mesh-test-secret"

# Waiting for a server process to bind is the only wait here (a process has no readiness event we can block on).
_READY_S = 10.0


class NetnsError(RuntimeError):
    """A namespace command failed; the message carries the command and its stderr."""


def netns_unavailable() -> str | None:
    """Why this machine cannot build the topology, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the netns tests as root)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2/iptables) is not installed"
    probe = f"mesh-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        rule = subprocess.run(
            ["ip", "netns", "exec", probe, "iptables", "-A", "INPUT", "-m", "conntrack", "--ctstate", "INVALID",
             "-j", "DROP"], capture_output=True, text=True)
        if rule.returncode != 0:
            return f"iptables conntrack rules do not work in a namespace here: {rule.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def coturn_unavailable() -> str | None:
    if shutil.which("turnserver") is None:
        return "coturn (turnserver) is not installed"
    return None


@dataclass
class _Bed:
    """Namespaces of one test bed and the helpers to run things in them (NatTopology, LanTopology)."""

    suffix: str
    workdir: str
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)
    _made: list[str] = field(default_factory=list, init=False)

    def cmd(self, ns: str, *argv: str) -> list[str]:
        """The argv that runs `argv` inside namespace `ns` (hand it to trio.run_process or subprocess)."""
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str | None, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a short command in `ns` (None: in the current namespace) and wait for it."""
        full = self.cmd(ns, *argv) if ns else list(argv)
        done = subprocess.run(full, capture_output=True, text=True)
        if check and done.returncode != 0:
            raise NetnsError(f"`{' '.join(full)}` failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def spawn(self, ns: str, argv: Sequence[str], **popen: object) -> subprocess.Popen[bytes]:
        """Start a long-running process in `ns`; it is killed at teardown if still running."""
        proc = subprocess.Popen(self.cmd(ns, *argv), **popen)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def _teardown(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for ns in reversed(self._made):
            # Deleting a namespace deletes its interfaces (and their veth peers), rules and conntrack entries.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _add_namespace(self, ns: str) -> None:
        self.run(None, "ip", "netns", "add", ns)
        self._made.append(ns)
        self.run(ns, "ip", "link", "set", "lo", "up")


    def wait_bound(self, ns: str, port: int, kind: str = "tcp", proc: subprocess.Popen[bytes] | None = None,
                   log: str | None = None) -> None:
        """Wait (bounded) until something in `ns` listens on `port` (`kind` tcp or udp), or `proc` dies."""
        flag = "-Hltn" if kind == "tcp" else "-Hlun"
        deadline = time.monotonic() + _READY_S
        while not self.run(ns, "ss", flag, f"sport = :{port}", check=False).stdout.strip():
            if proc is not None and proc.poll() is not None:
                raise NetnsError(f"{proc.args} exited with {proc.returncode}: {_tail(log) if log else ''}")
            if time.monotonic() > deadline:
                raise NetnsError(f"nothing listens on {kind} port {port} in {ns} after {_READY_S} s")
            time.sleep(0.02)

    def listen_tcp(self, ns: str, host: str, port: int) -> subprocess.Popen[bytes]:
        """A TCP listener in `ns` that accepts and closes connections: something a dial could reach."""
        code = ("import socket\n"
                f"s = socket.create_server(({host!r}, {port}))\n"
                "while True:\n    s.accept()[0].close()\n")
        proc = self.spawn(ns, [sys.executable, "-c", code])
        self.wait_bound(ns, port, "tcp", proc)
        return proc

    def try_connect(self, ns: str, host: str, port: int, timeout: float = 1.0) -> str:
        """Dial host:port over TCP from inside `ns`: "connected", or the error (e.g. "timeout", an OSError)."""
        code = ("import socket, sys\n"
                f"try:\n    socket.create_connection(({host!r}, {port}), timeout={timeout}).close()\n"
                "    print('connected')\n"
                "except TimeoutError:\n    print('timeout')\n"
                "except OSError as e:\n    print(type(e).__name__ + ': ' + str(e))\n")
        return self.run(ns, sys.executable, "-c", code).stdout.strip()


@dataclass
class NatTopology(_Bed):
    """Names of the five namespaces of the NAT test bed."""

    symmetric: bool = False
    pub: str = field(init=False)
    nat_a: str = field(init=False)
    nat_b: str = field(init=False)
    peer_a: str = field(init=False)
    peer_b: str = field(init=False)

    def __post_init__(self) -> None:
        for role in ("pub", "nat_a", "nat_b", "peer_a", "peer_b"):
            setattr(self, role, f"mesh-{self.suffix}-{role.replace('_', '')}")

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.pub, self.nat_a, self.nat_b, self.peer_a, self.peer_b)

    def start_coturn(self, *, user: str = TURN_USER, password: str = TURN_PASS) -> str:
        """Run coturn (STUN and TURN with long-term credentials) on the public segment; return its log path."""
        if (reason := coturn_unavailable()) is not None:
            raise NetnsError(reason)
        log = os.path.join(self.workdir, "coturn.log")
        argv = [
            "turnserver", "-n", f"--listening-ip={PUB_IP}", f"--relay-ip={PUB_IP}", f"--listening-port={STUN_PORT}",
            "--realm=mesh", "--lt-cred-mech", f"--user={user}:{password}", "--no-tls", "--no-dtls", "--no-cli",
            "--log-file=stdout", "--simple-log", f"--pidfile={self.workdir}/coturn.pid",
            f"--userdb={self.workdir}/turndb", "--min-port=49152", "--max-port=49999",
        ]
        with open(log, "wb") as out:
            proc = self.spawn(self.pub, argv, stdout=out, stderr=subprocess.STDOUT)
        self.wait_bound(self.pub, STUN_PORT, "udp", proc, log)
        return log

    # --- building and tearing down ------------------------------------------------------------------------------
    def _build(self) -> None:
        for ns in self.namespaces:
            self._add_namespace(ns)
        pub = self.pub
        self.run(pub, "ip", "link", "add", "br0", "type", "bridge")
        self.run(pub, "ip", "addr", "add", f"{PUB_IP}/24", "dev", "br0")
        self.run(pub, "ip", "link", "set", "br0", "up")
        # A veth whose other end goes nowhere: the dummy driver is not always available.
        self.run(pub, "ip", "link", "add", "stub0", "type", "veth", "peer", "name", "stub1")
        self.run(pub, "ip", "link", "set", "stub1", "up")
        self.run(pub, "ip", "link", "set", "stub0", "up")
        self.run(pub, "ip", "route", "add", "default", "dev", "stub0")
        for nat, peer, wan_ip, lan_net, port in (
            (self.nat_a, self.peer_a, NAT_A_WAN, "198.19.1", "pa"),
            (self.nat_b, self.peer_b, NAT_B_WAN, "198.19.2", "pb"),
        ):
            self.run(None, "ip", "link", "add", "wan0", "netns", nat, "type", "veth", "peer", "name", port,
                     "netns", pub)
            self.run(pub, "ip", "link", "set", port, "master", "br0", "up")
            self.run(nat, "ip", "addr", "add", f"{wan_ip}/24", "dev", "wan0")
            self.run(nat, "ip", "link", "set", "wan0", "up")
            self.run(None, "ip", "link", "add", "lan0", "netns", nat, "type", "veth", "peer", "name", "eth0",
                     "netns", peer)
            self.run(nat, "ip", "addr", "add", f"{lan_net}.1/24", "dev", "lan0")
            self.run(nat, "ip", "link", "set", "lan0", "up")
            self.run(peer, "ip", "addr", "add", f"{lan_net}.2/24", "dev", "eth0")
            self.run(peer, "ip", "link", "set", "eth0", "up")
            self.run(peer, "ip", "route", "add", "default", "via", f"{lan_net}.1")
            self.run(nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            masquerade = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"]
            self.run(nat, *masquerade, *(["--random"] if self.symmetric else []))
            for chain in ("INPUT", "FORWARD"):
                self.run(nat, "iptables", "-A", chain, "-i", "wan0", "-m", "conntrack", "--ctstate", "NEW,INVALID",
                         "-j", "DROP")



@contextmanager
def nat_topology(*, symmetric: bool = False) -> Iterator[NatTopology]:
    """Build the five-namespace NAT test bed; tear it down (processes included) even when the body fails."""
    net = NatTopology(uuid.uuid4().hex[:8], tempfile.mkdtemp(prefix="mesh-netns-"), symmetric=symmetric)
    try:
        net._build()
        yield net
    finally:
        net._teardown()


LAN_NET = "198.18.8"


@dataclass
class LanTopology(_Bed):
    """One LAN segment: a switch namespace with bridge br0, and one namespace per host with eth0 on it
    (LAN_NET.11, .12, ... /24 in the order given), no router and no default route, as on a home network's
    Wi-Fi or switch. Multicast and broadcast cross the bridge."""

    hosts: tuple[str, ...] = ()
    switch: str = field(init=False)
    ns: dict[str, str] = field(init=False)
    ip: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.switch = f"mesh-{self.suffix}-sw"
        self.ns = {h: f"mesh-{self.suffix}-{h}" for h in self.hosts}
        self.ip = {h: f"{LAN_NET}.{11 + i}" for i, h in enumerate(self.hosts)}

    def _build(self) -> None:
        self._add_namespace(self.switch)
        self.run(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self.run(self.switch, "ip", "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.ns[host]
            self._add_namespace(ns)
            self.run(None, "ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                     "netns", self.switch)
            self.run(self.switch, "ip", "link", "set", f"p{i}", "master", "br0", "up")
            self.run(ns, "ip", "addr", "add", f"{self.ip[host]}/24", "dev", "eth0")
            self.run(ns, "ip", "link", "set", "eth0", "up")


@contextmanager
def lan_topology(*hosts: str) -> Iterator[LanTopology]:
    """Build one LAN segment with a namespace per host; tear it down (processes included) even when the body
    fails."""
    net = LanTopology(uuid.uuid4().hex[:8], tempfile.mkdtemp(prefix="mesh-netns-"), hosts=tuple(hosts))
    try:
        net._build()
        yield net
    finally:
        net._teardown()


def _tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"
